"""Loading the unwrapped model's checkpoint into a wrapped model (and its optimizer) at any
world size, from whatever holds it: a ``Source`` describes what is stored, in the DCP
layout's keys and DCP's metadata types (``formats.dcp.layout``), and reads the pieces a rank asks
for. ``load_dcp`` reads DCP directories through one; ``load_consolidated`` reads
``.pth``, safetensors files and Hugging Face directories through others (``sources``).

[Note: nothing changes unless everything was read]
Every check against what is stored (keys, shapes, the optimizer's class and groups, the
data files) comes first, and every value is read into a staging buffer on the host. Only
when every rank has read all it needs (``coordination.agree``) are the shards, buffers and
optimizer state replaced, so a bad checkpoint leaves the model and optimizer as they were,
on every rank. Putting them in place can still be refused on one rank: torch's optimizer
``load_state_dict`` checks the state against the optimizer (and runs the user's hooks), and
a module's ``set_extra_state`` is the model's own code. So the optimizer's state and the
modules' extra state go in first, on every rank, and the ranks agree on them; when any rank
refused, every rank puts back the optimizer state and extra state it replaced (held only
until the agreement) and raises, before any shard or buffer has changed. Copying the
values into the shards and buffers comes after, and no copy of what they held is kept: that
would keep a second copy of every shard for the whole agreement (in HBM, the old buffers; on
virtual devices, where a rendezvous syncs, materialized clones). What torch would refuse of
that copy (keys, shapes) was refused before it; what else can fail it (a device out of
memory, or on a rank's own file a module's own ``load_state_dict`` hook raising) fails every
rank through a second agreement, with the model as far as the copy got.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, TensorStorageMetadata)

from .._sharding.chunks import Chunk, TensorPieces
from .async_save import wait_for_pending
from .coordination import agree_or_undo, every_rank_agrees, naming
from .formats.dcp.layout import (GET_STATE_DICT, KEY_SCHEMES, KeyScheme, rank_extra_key,
                                rank_extras, replica_extra_key)
from .files import CheckpointError
from .live_model import (ParamSlot, extra_state_holders, param_slots, persistent_buffers,
                         replica_index, slots_by_shard)
from .optimizer_state import (GROUP_MEMBERS, holds_settings_of, param_group_settings,
                              refuse_foreign_params, shard_state_is_sharded)
from .formats.keys import EXTRA, OPTIMIZER
from .unit_protocol import ShardedModel

Stored = Union[TensorStorageMetadata, BytesStorageMetadata]


class Source(Protocol):
    """A checkpoint as ``StagedLoad`` reads it."""
    where: str                  # what to name in errors: a directory or file
    stored: Dict[str, Stored]   # every entry, under the DCP layout's keys

    def read(self, tensors: Dict[str, TensorPieces], objects: Dict[str, Any],
             into: Dict[str, Any]) -> None:
        """Fills each of ``tensors``' chunks with the stored values there (converted to the
        chunk's dtype), and ``into[key]`` with each stored object named in ``objects``."""

    def close(self) -> None:
        """Releases the files it holds open."""


class StagedLoad:
    """Everything a rank loads from ``source``, read into host buffers, and how to put it in
    place (``commit``). With ``with_model=False`` only the optimizer's state is loaded. With
    ``strict=False`` parameters and buffers the source lacks keep their values and entries
    the model lacks are passed over; both are listed in ``missing`` and ``unexpected``."""

    def __init__(self, source: Source, model: ShardedModel,
                 optimizer: Optional[torch.optim.Optimizer], with_model: bool = True,
                 strict: bool = True) -> None:
        self.source = source
        self.where = source.where
        self.stored = source.stored
        self.tensors: Dict[str, TensorPieces] = {}
        self.objects: Dict[str, Any] = {}
        # what may refuse (torch's optimizer load, a module's set_extra_state), each
        # returning how to put back what it replaced
        self.refusables: List[Callable[[], Callable[[], None]]] = []
        self.copies: List[Callable[[], None]] = []   # into the shards and buffers
        self.missing: List[str] = []
        self.unexpected: List[str] = []
        slots = param_slots(model)
        self.scheme = _scheme_of(self.stored, [n for s in slots for n in s.names])
        if with_model:
            self._model(model, slots, strict)
        if optimizer is not None:
            self._optimizer(optimizer, slots)
        extra = _extra_key(self.stored, model)
        if extra is not None:
            self.objects[extra] = None
        self.source.read(self.tensors, self.objects, into=self.objects)
        self.extra = None if extra is None else self.objects.get(extra)

    # -- the model -------------------------------------------------------------------------
    def _model(self, model: ShardedModel, slots: List[ParamSlot], strict: bool) -> None:
        """A tied or shared parameter may be stored under any of its names (a Hugging Face
        directory holds one, as ``save_pretrained`` writes it); it is read from the first
        one stored, and every one stored must have its shape."""
        buffers = persistent_buffers(model)
        holders = extra_state_holders(model)
        whole = [n for n, _ in buffers] + [n for n, _ in holders]
        names = [n for s in slots for n in s.names] + whole
        prefix = self.scheme.model("")[0]
        if self.scheme.bare_model:  # the model's namespace: keys under its top-level names
            tops = {n.split(".", 1)[0] for n in names}
            present = {k for k in self.stored if k.split(".", 1)[0] in tops}
        else:
            present = {k for k in self.stored if k.startswith(prefix)}
        held = [[n for n in s.names if self.scheme.model(n)[0] in present] for s in slots]
        self.missing = sorted([s.name for s, h in zip(slots, held) if not h]
                              + [n for n in whole if self.scheme.model(n)[0] not in present])
        self.unexpected = sorted(k[len(prefix):] for k in
                                 present - {self.scheme.model(n)[0] for n in names})
        if (self.missing or self.unexpected) and strict:
            raise CheckpointError(
                f"{self.where} does not hold this model: missing {self.missing}, unexpected "
                f"{self.unexpected} (read with {self.scheme.name}'s keys); strict=False "
                f"loads what it holds of the model and leaves the rest")
        stages: Dict[int, torch.Tensor] = {}
        partial = {id(s.shard_group.shard) for s, h in zip(slots, held) if not h}
        for slot, names_held in zip(slots, held):
            if not names_held:
                continue
            shard = slot.shard_group.shard
            for name in names_held:
                self._check_shape(self.scheme.model(name)[0], f"parameter '{name}'", slot.shape)
            if id(shard) not in stages:  # a shard some of whose parameters stay as they are
                stages[id(shard)] = (shard.detach().cpu().reshape(-1).clone()
                                     if id(shard) in partial
                                     else torch.zeros(shard.numel(), dtype=shard.dtype))
                self.copies.append(functools.partial(_copy_into_shard, slot.shard_group,
                                                     stages[id(shard)]))
            self._want(self.scheme.model(names_held[0])[0], slot.shape, shard.dtype,
                       list(slot.pieces), stages[id(shard)])
        for name, buf in buffers:
            key = self.scheme.model(name)[0]
            if key not in present:  # not strict
                continue
            self._check_shape(key, f"buffer '{name}'", buf.shape)
            self.copies.append(functools.partial(_copy, buf, self._want_whole(key)))
        for name, module in holders:  # see [Note: modules' extra state] in live_model
            key = self.scheme.model(name)[0]
            if key not in present:  # not strict
                continue
            stored = self.stored[key]
            if isinstance(stored, TensorStorageMetadata):
                value = functools.partial(torch.Tensor.reshape, self._want_whole(key),
                                          tuple(stored.size))
            else:
                self.objects[key] = None
                value = functools.partial(self.objects.get, key)
            self.refusables.append(functools.partial(_set_extra_state, module, value))

    def _check_shape(self, key: str, what: str, shape: torch.Size) -> None:
        stored = self.stored[key]
        if not isinstance(stored, TensorStorageMetadata):
            raise CheckpointError(f"{self.where}: {what} is stored as an object, not a tensor")
        if tuple(stored.size) != tuple(shape):
            raise CheckpointError(f"{self.where}: {what} has shape {list(stored.size)} in "
                                  f"the checkpoint and {list(shape)} in the model")

    def _want(self, key: str, size: torch.Size, dtype: torch.dtype,
              chunks: List[Tuple[Chunk, int]], stage: torch.Tensor) -> None:
        """Reads ``chunks`` of ``key`` into ``stage``, each from where it starts there."""
        self.tensors[key] = TensorPieces(torch.Size(size), dtype, chunks, lambda: stage)

    def _want_whole(self, key: str) -> torch.Tensor:
        stored = self.stored[key]
        stage = torch.zeros(stored.size, dtype=stored.properties.dtype).reshape(-1)
        whole = Chunk((0,) * len(stored.size), tuple(stored.size), 0)
        self._want(key, stored.size, stored.properties.dtype, [(whole, 0)], stage)
        return stage

    # -- the optimizer -----------------------------------------------------------------------
    def _optimizer(self, optimizer: torch.optim.Optimizer, slots: List[ParamSlot]) -> None:
        if not any(k.startswith(OPTIMIZER + ".") for k in self.stored):
            raise CheckpointError(f"{self.where} holds no optimizer state")
        settings_of = self._saved_settings()
        by_shard = slots_by_shard(slots)
        kind = type(optimizer).__name__
        for name, settings in settings_of.items():
            if not holds_settings_of(optimizer, settings):
                raise CheckpointError(
                    f"{self.where}: its optimizer's settings for '{name}' are "
                    f"{sorted(settings)}, but {kind} has {sorted(optimizer.defaults)}: the "
                    f"checkpoint was saved from another optimizer class")
        refuse_foreign_params(optimizer, by_shard)
        new_groups, state, held = [], {}, set()
        index = 0
        for j, param_group in enumerate(optimizer.param_groups):
            names = [s.name for p in param_group["params"] for s in by_shard[id(p)]]
            unknown = [n for n in names if n not in settings_of]
            if unknown:
                raise CheckpointError(
                    f"{self.where}: its optimizer has no param group for "
                    f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''} ({kind}'s group {j})")
            first = settings_of[names[0]] if names else None
            odd = next((n for n in names[1:] if settings_of[n] is not first
                        and _settings_differ(settings_of[n], first)), None)
            if odd is not None:
                raise CheckpointError(
                    f"{self.where}: {kind}'s param group {j} holds '{names[0]}' and '{odd}', "
                    f"which were saved in param groups of other settings "
                    f"({_settings_differ(first, settings_of[odd])}); build the "
                    f"optimizer's param groups as they were saved")
            # a group of no parameters has no saved settings to find: it keeps its own
            settings = param_group_settings(param_group) if first is None else first
            new_groups.append(dict(settings,
                                   params=list(range(index, index + len(param_group["params"])))))
            for p in param_group["params"]:
                entry = self._param_state(p, by_shard[id(p)])
                if entry:
                    state[index] = entry
                held.update(s.name for s in by_shard[id(p)])
                index += 1
        prefix = f"{OPTIMIZER}.state."
        stray = sorted({k[len(prefix):].rsplit(".", 1)[0] for k in self.stored
                        if k.startswith(prefix)} - held)
        if stray:
            raise CheckpointError(f"{self.where} holds optimizer state for parameters this "
                                  f"optimizer does not hold: {stray[:10]}")
        self.refusables.append(lambda: load_optimizer_state(optimizer, {
            "state": {i: {k: v() for k, v in s.items()} for i, s in state.items()},
            "param_groups": new_groups}))

    def _saved_settings(self) -> Dict[str, Dict[str, Any]]:
        """{parameter name: the settings of its param group}, from either form DCP
        checkpoints hold: get_state_dict's (``param_groups.<i>.<setting>``, each group
        listing its parameters' names under ``params``) or the flattened one torchtitan saves
        (``flatten_optimizer_state_dict``: ``param_groups.<name>.<setting>``)."""
        prefix = f"{OPTIMIZER}.param_groups."
        keys = [k for k in self.stored if k.startswith(prefix)]
        self.source.read({}, {k: None for k in keys}, into=self.objects)
        indexed: Dict[int, Dict[str, Any]] = {}
        out: Dict[str, Dict[str, Any]] = {}
        for key in keys:
            owner, setting = key[len(prefix):].rsplit(".", 1)
            value = self.objects.pop(key)
            if owner.isdigit():
                indexed.setdefault(int(owner), {})[setting] = value
            elif setting not in GROUP_MEMBERS:
                out.setdefault(owner, {})[setting] = value
        for saved in indexed.values():
            settings = param_group_settings(saved)
            out.update((name, settings) for name in saved.get("params", []))
        if not out:
            raise CheckpointError(f"{self.where}: its optimizer state has no param_groups")
        return out

    def _param_state(self, shard: torch.Tensor, slots: List[ParamSlot]
                     ) -> Dict[str, Callable[[], Any]]:
        """The optimizer state of one shard, as thunks over what will have been read."""
        prefix = self.scheme.state(slots[0].name, "")[0]
        names = [k[len(prefix):] for k in self.stored if k.startswith(prefix)]
        out: Dict[str, Callable[[], Any]] = {}
        for name in names:
            keys = [self.scheme.state(s.name, name)[0] for s in slots]
            missing = [k for k in keys if k not in self.stored]
            if missing:
                raise CheckpointError(f"{self.where}: optimizer state {missing[0]} is missing")
            stored = self.stored[keys[0]]
            if isinstance(stored, BytesStorageMetadata):
                self.objects[keys[0]] = None
                out[name] = lambda key=keys[0]: self.objects[key]
                continue
            if shard_state_is_sharded(self.where, name, [
                    (k, self.stored[k], s.shape) for k, s in zip(keys, slots, strict=True)]):
                stage = torch.zeros(shard.numel(), dtype=stored.properties.dtype)
                for key, slot in zip(keys, slots):
                    self._want(key, slot.shape, stored.properties.dtype, list(slot.pieces),
                               stage)
                out[name] = lambda stage=stage: stage.view(shard.shape)
            else:  # the same for every parameter (a step count)
                stage = self._want_whole(keys[0])
                out[name] = lambda stage=stage, size=stored.size: stage.view(size)
        return out


def _settings_differ(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    """The settings two saved param groups give other values (a tensor ``lr`` compared by
    value)."""
    def same(x: Any, y: Any) -> bool:
        if torch.is_tensor(x) or torch.is_tensor(y):
            return torch.is_tensor(x) and torch.is_tensor(y) and torch.equal(x, y)
        return x == y
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not same(a[k], b[k]))


def _scheme_of(stored: Dict[str, Any], names: List[str]) -> KeyScheme:
    """The key scheme whose model keys the checkpoint holds more of (``get_state_dict``'s if
    neither: its keys are then the ones reported missing)."""
    def held(scheme: KeyScheme) -> int:
        return sum(scheme.model(n)[0] in stored for n in names)
    return max(KEY_SCHEMES.values(), key=lambda s: (held(s), s is GET_STATE_DICT))


def _copy_into_shard(shard_group: Any, stage: torch.Tensor) -> None:
    _copy(shard_group.shard, stage)
    shard_group.mark_updated()  # full parameters gathered before are stale


def _copy(target: torch.Tensor, stage: torch.Tensor) -> None:
    target.copy_(stage.view(target.shape).to(target.dtype).to(target.device))


def _set_extra_state(module: Any, value: Callable[[], Any]) -> Callable[[], None]:
    """Gives ``module`` its stored extra state and returns how to put back the one it
    replaced (see [Note: modules' extra state]); ``set_extra_state`` is the model's own code
    and may raise, and then the old state is put back before the error goes on."""
    replaced = module.get_extra_state()
    try:
        module.set_extra_state(value())
    except BaseException:
        module.set_extra_state(replaced)
        raise
    return functools.partial(module.set_extra_state, replaced)


def load_optimizer_state(optimizer: torch.optim.Optimizer,
                         state_dict: Dict[str, Any]) -> Callable[[], None]:
    """``optimizer.load_state_dict``, which checks the state before changing anything; returns
    how to put back the tensors it held, which loading replaced rather than changed."""
    before = optimizer.state_dict()
    optimizer.load_state_dict(state_dict)
    return lambda: optimizer.load_state_dict(before)



def _extra_key(stored: Any, model: ShardedModel) -> Optional[str]:
    """[Note: each rank's extra]
    ``extra`` is what a training loop saves beside the state (a step, a scheduler's state),
    usually the same on every rank; where the ranks saved different ones (a per-rank data
    position or RNG state), per-rank files hold each rank's, and a DCP save keeps each
    rank's beside the first rank's. Every rank then gets its own back at the world size
    that saved it, whatever the loader; at another world size there is no own one, and
    every rank gets the first rank's. Before, a DCP checkpoint and every per-rank load that
    did not read the rank's own file alone gave all ranks the first rank's, silently."""
    # see [Note: each replica's extra]: a group of the size that saved them
    replica = replica_extra_key(model.rank, replica_index(model))[0]
    same_replica = replica.rsplit(".rank", 1)[0] + ".rank"
    if replica in stored and sum(k.startswith(same_replica) for k in stored) == model.world_size:
        return replica
    own = rank_extra_key(model.rank)[0]
    if own in stored and len(rank_extras(stored)) == model.world_size:
        return own
    return EXTRA if EXTRA in stored else None


def load_staged(open_source: Callable[[], Source], model: ShardedModel,
                optimizer: Optional[torch.optim.Optimizer], tag: str,
                with_model: bool = True, strict: bool = True) -> "StagedLoad":
    """Stages on every rank, agrees, commits (see [Note: nothing changes unless everything
    was read]); returns what was loaded (its ``extra``: what was saved with it)."""
    import torch_xla
    wait_for_pending(model)  # a save of this model in flight is published first
    torch_xla.sync()
    with every_rank_agrees(f"{tag}.read"):
        with contextlib.closing(open_source()) as source:
            staged = StagedLoad(source, model, optimizer, with_model, strict)
    commit_on_every_rank(tag, staged.where, staged.refusables, staged.copies)
    torch_xla.sync()
    return staged


def commit_on_every_rank(tag: str, where: str,
                         refusables: List[Callable[[], Callable[[], None]]],
                         copies: List[Callable[[], None]]) -> None:
    """Every rank runs the ``refusables`` in turn (the optimizer's load and the modules' extra
    state, which change nothing if they raise and return their undo) and the ranks agree:
    when one refused, every rank undoes the ones it ran and raises, naming the failing rank
    and ``where``. Then every rank runs the ``copies`` and the ranks agree again (see [Note:
    nothing changes unless everything was read])."""
    error: Optional[BaseException] = None
    undos: List[Callable[[], None]] = []

    def undo() -> None:
        for each in reversed(undos):
            each()
    try:
        try:
            for refusable in refusables:
                undos.append(refusable())
        except BaseException:  # this rank's refusal is undone here, before the agreement
            try:
                undo()
            finally:
                undos.clear()
            raise
    except Exception as exc:  # every rank must reach the agreement
        error = CheckpointError(f"{where}: {type(exc).__name__}: {exc}")
    try:
        agree_or_undo(f"{tag}.commit", error, undo)
    finally:
        # see [Note: no frame keeps the exception it raises]; and the optimizer's old state
        # goes before the shards are written
        error = None
        undos.clear()
    with every_rank_agrees(f"{tag}.copied", naming(where)), torch.no_grad():
        for copy in copies:
            copy()
