"""A live model's consolidated checkpoint, gathered over the collectives as a writer reads it:
``save_consolidated`` on pods whose hosts share no filesystem, and ``full_state_dict``.

``gathered_state`` gives every rank the model's ``UnwrappedState``: each parameter, and each
optimizer state sharded like it, is cut from its shard group gathered whole
(``Layout.unshard``); buffers, modules' extra state and state
that is not sharded (``step``) are this rank's own copy. ``Gathers`` runs the collectives that fill the cuts.

[Note: every rank knows the writer's read order]
The writers read tensors in orders of their own, each fixed by our code: the model's entries
in parameter order, the optimizer's state a state name at a time across a shard's parameters
(``NamedState.in_read_order``), DCP's in its plan's order (DCP's writer, with one thread and
no copy-ahead, asks for a file's tensors in the order it is given them:
``writers.dcp_files.local_plan``). ``UnwrappedState.read_order`` lists those reads. The state
is built from shapes only, so every rank builds the same one and lists the same reads, and
from them the device tensors to gather (a shard, or one state of a shard, within its sharding
group). Every rank then gathers those in that order, in runs of ``coordination.runs_by_size``
with one sync each; the writing rank keeps the run it reads from on its host. No rank waits
for another's request: a read of a tensor that is not in a run ahead of the writer raises
instead of gathering out of turn, and a writer that stops early gathers the rest without
keeping it, so that every rank finishes its runs before the save's agreement. The ranks of
each sharding group check that they list the same gathers before the first one (with
independent ``sharding_groups``, parts of a model-parallel model, each group its own).
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .._sharding.layout import Layout
from .._sharding.names import join_name
from .._unit.buffers import original_dtype
from .async_save import copy_of_extra
from .coordination import exchange, gathered_bytes, gathered_on_host, runs_by_size
from .files import CheckpointError
from .live_model import (extra_state_tensors, parameter_order, persistent_buffers,
                         sharding_group_index, tied_aliases, unit_aliases, units_by_saved_path,
                         unwrapped_name)
from .optimizer_state import live_state, optimizer_shard_keys, saved_state_dict, walk_state
from .formats.keys import EXTRA
from .unit_protocol import ShardedModel
from .unwrapped_state import Member, UnwrappedState, holding, named_state


class Gathers:
    """The device tensors a save gathers, in the writer's read order (see [Note: every rank
    knows the writer's read order]), as one rank takes part in them."""

    def __init__(self, tensors: Dict[str, Tuple[torch.Tensor, Any]],
                 sharding_group: Optional[int]) -> None:
        self._tensors = tensors          # id -> (device tensor, its unit's collectives)
        self._sharding_group = sharding_group  # this rank's, None without sharding_groups
        self._runs: List[List[str]] = []
        self._next = 0
        self._keep = False
        self._held: Dict[str, torch.Tensor] = {}

    def follow(self, reads: Sequence[Any], keep: bool) -> None:
        """Sets the order from the writer's ``reads``; ``keep`` on the writing rank. Every
        rank calls it, and every rank raises if a rank lists other tensors than the rest of
        its sharding group."""
        order: List[str] = []
        for read in reads:
            # a cut is gathered; anything else is this rank's own
            if isinstance(read, _Cut) and math.prod(read.shape) \
                    and (not order or order[-1] != read.tid):
                order.append(read.tid)
        # names and sizes: the sizes cut the runs, so every rank must see the same ones
        digest = hashlib.sha256(repr([(t, self._full_bytes(t)) for t in order]).encode()
                                ).hexdigest()
        listed: Dict[Optional[int], set] = {}
        for sharding_group, listing in exchange("xla_fsdp.gathered.order",
                                                (self._sharding_group, digest)):
            listed.setdefault(sharding_group, set()).add(listing)
        if any(len(listings) > 1 for listings in listed.values()):
            raise CheckpointError("the ranks of a sharding group would gather different tensors "
                                  "for the consolidated save; they must wrap the same model")
        self._runs = [list(dict.fromkeys(run)) for run in runs_by_size(order, self._full_bytes)]
        self._keep = keep

    def _full_bytes(self, tid: str) -> int:
        return gathered_bytes(*self._tensors[tid])

    def _gather(self, run: List[str]) -> Dict[str, torch.Tensor]:
        import torch_xla
        on_device = []
        for tid in run:
            tensor, collectives = self._tensors[tid]
            if tensor.device.type != "xla":  # offloaded: the shard and its state on the host
                tensor = tensor.to(torch_xla.device())
            on_device.append((tensor, collectives))
        fulls = gathered_on_host(on_device, self._keep)  # every rank takes part
        return dict(zip(run, fulls, strict=True)) if self._keep else {}

    def fetch(self, tid: str) -> torch.Tensor:
        """Every rank's ``tid`` concatenated in rank order, on the writing rank's host."""
        while tid not in self._held:
            if self._next == len(self._runs):
                raise CheckpointError(f"the consolidated save read {tid} out of the order every "
                                      f"rank gathers in")
            self._held = {}  # dropped before the next run is gathered
            self._next += 1  # first: a run that raised after its collectives is not redone
            self._held = self._gather(self._runs[self._next - 1])
        return self._held[tid]

    def finish(self) -> None:
        """Takes part in the runs not gathered yet: all of them on a rank that does not write,
        the rest on a writer that stopped early."""
        self._held, self._keep = {}, False
        while self._next < len(self._runs):
            self._next += 1
            self._gather(self._runs[self._next - 1])


class _Cut:
    """One tensor of the unwrapped model (a parameter, or optimizer state sharded like it):
    tensor ``index`` of ``layout``, cut from the gathered device tensor ``tid``."""

    def __init__(self, gathers: Gathers, tid: str, layout: Layout, index: int,
                 dtype: torch.dtype) -> None:
        self._gathers, self._layout, self._index = gathers, layout, index
        self.tid, self.dtype = tid, dtype
        self.shape: Tuple[int, ...] = tuple(layout.shapes[index])

    def read(self) -> torch.Tensor:
        if not math.prod(self.shape):   # nothing to gather (``Gathers.follow`` leaves it out)
            return torch.empty(self.shape, dtype=self.dtype)
        full = self._layout.unshard(self._gathers.fetch(self.tid))[self._index]
        return full.clone(memory_format=torch.contiguous_format)


class _Own:
    """A tensor this rank holds whole (a buffer, ``step``), copied to the host in the dtype
    it is saved in when read."""

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        self._tensor, self.dtype = tensor, dtype
        self.shape: Tuple[int, ...] = tuple(tensor.shape)

    def read(self) -> torch.Tensor:
        return self._tensor.detach().to("cpu", self.dtype, copy=True)


_Slot = Tuple[Layout, List[str], Any]  # a shard group's layout, unwrapped names, collectives


class _Sharded(NamedTuple):
    """Optimizer state sharded like its shard, gathered as ``tid``."""
    tid: str
    dtype: torch.dtype


def read_every_entry(state: UnwrappedState, gathers: Gathers, keep: bool
                     ) -> Dict[str, torch.Tensor]:
    """Every model entry of ``state`` read on the rank that ``keep``s them (the others take
    part and get nothing), each device tensor gathered once: the entries cut from one are
    read together, in the order their tensors first appear, though the model's order
    interleaves them (a scanned stack's layers, a unit's trainable and frozen shard groups
    alternate module by module), and the result is in the model's order. Every rank calls
    it."""
    first: Dict[Any, int] = {}
    for name, tensor in state.tensors.items():
        first.setdefault(tensor.tid if isinstance(tensor, _Cut) else name, len(first))
    grouped = sorted(state.tensors.items(), key=lambda item: first[
        item[1].tid if isinstance(item[1], _Cut) else item[0]])
    gathers.follow([tensor for _, tensor in grouped], keep)
    try:
        read = {name: tensor.read() for name, tensor in grouped} if keep else {}
        return {name: read[name] for name in state.tensors} if keep else {}
    finally:
        gathers.finish()  # every rank takes part in every run, the keeper's unread ones too


def gathered_state(model: ShardedModel, optimizer: Optional[torch.optim.Optimizer],
                   extra: Any = None, what: str = "save_consolidated"
                   ) -> Tuple[UnwrappedState, Gathers]:
    """``model``'s consolidated checkpoint (with ``optimizer``'s state when given) and the
    ``Gathers`` its cuts read through, on every rank; ``what`` names the save in errors.
    Every rank calls ``Gathers.follow`` with the same reads, and ``Gathers.finish`` at the
    end."""
    import torch_xla
    torch_xla.sync()
    tensors: Dict[str, Tuple[torch.Tensor, Any]] = {}   # gather id -> device tensor, collectives
    gathers = Gathers(tensors, sharding_group_index(model))
    slots: Dict[str, _Slot] = {}                        # shard key (as saved) -> its group
    cuts: Dict[str, _Cut] = {}
    units = list(model.named_units())
    saved_units = units_by_saved_path(model, units)
    for (path, unit), (saved, _) in zip(units, saved_units, strict=True):
        for g in unit.shard_groups:
            key = join_name(saved, g.shard_name)  # also the gather id: the state dict's key
            tensors[key] = (g.shard, unit.collectives)
            slots[key] = (g.layout, [unwrapped_name(path, n) for n in g.names],
                          unit.collectives)
            for i, name in enumerate(slots[key][1]):
                cuts[name] = _Cut(gathers, key, g.layout, i, g.shard.dtype)
    order = parameter_order(model, saved_units) or list(cuts)
    entries: Dict[str, Any] = {n: cuts[n] for n in order}
    entries.update((n, c) for n, c in cuts.items() if n not in entries)
    entries.update((n, _Own(b, original_dtype(b))) for n, b in persistent_buffers(model))
    entries.update((n, _Own(t, t.dtype))
                   for n, t in extra_state_tensors(model, what))
    aliases = tied_aliases(unit_aliases(model, units).items())
    named = None if optimizer is None else _named_optimizer_state(
        model, optimizer, gathers, tensors, slots, order)
    # on the host, as every other save keeps it: DCP's writer stores no device tensor
    kept = {} if extra is None else {EXTRA: copy_of_extra(extra)}
    return UnwrappedState(entries, aliases, named, kept), gathers


def _named_optimizer_state(model: ShardedModel, optimizer: torch.optim.Optimizer,
                           gathers: Gathers, tensors: Dict[str, Tuple[torch.Tensor, Any]],
                           slots: Dict[str, _Slot], order: List[str]) -> Any:
    """The live optimizer's state by parameter name (``unwrapped_state.named_state``): each
    value sharded like its shard a cut gathered as ``"<shard key>#<state name>"``. Its param
    groups are ``optimizer.state_dict()``'s, as the per-rank files hold them (a state dict
    hook's or an override's changes included), not the live ``param_groups``."""
    keys = optimizer_shard_keys(model, optimizer)
    params, by_index = live_state(optimizer)
    values: Dict[int, Dict[str, Any]] = {i: {} for i in by_index}
    for s in walk_state(by_index, lambda i: params[i].shape,
                        lambda i: f"consolidated save, {holding(slots[keys[i]][1])}"):
        _, _, collectives = slots[keys[s.index]]
        if s.sharded:
            tid = f"{keys[s.index]}#{s.name}"
            tensors[tid] = (s.value, collectives)
            values[s.index][s.name] = _Sharded(tid, s.value.dtype)
        else:
            values[s.index][s.name] = _Own(s.value, s.value.dtype) if torch.is_tensor(s.value) \
                else s.value

    def state_of(member: Member) -> Optional[Dict[str, Any]]:
        name, key, index = member
        if index not in values:
            return None
        layout, names, _ = slots[key]
        at = names.index(name)
        return {k: _Cut(gathers, v.tid, layout, at, v.dtype) if isinstance(v, _Sharded) else v
                for k, v in values[index].items()}
    param_groups = [(param_group, [(name, keys[i], i) for i in param_group["params"]
                                   for name in slots[keys[i]][1]])
                    for param_group in saved_state_dict(optimizer)["param_groups"]]
    return named_state(param_groups, order, state_of)
