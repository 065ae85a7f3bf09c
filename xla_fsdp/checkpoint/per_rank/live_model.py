"""A live model's per-rank checkpoint, read over the collectives instead of from files:
consolidation from training code on pods whose hosts share no filesystem.

``gathered_shard_set`` gives every rank a ``ShardSet`` whose rank files are views of the
ranks' device tensors, and ``Gathers`` the collectives that fill them. Every consolidated
output (``.pth``, safetensors, HF directory, DCP) then runs on it unchanged on the writing
rank; no rank opens a file of another.

[Note: every rank knows the writer's read order]
The writers read tensors in orders of their own, each fixed by our code: the model's entries
in parameter order, the optimizer's state a state name at a time across a shard's
parameters (``NamedState.in_read_order``), DCP's in its plan's order (DCP's writer, with one
thread and no copy-ahead, asks for a file's tensors in the order it is given them:
``dcp_format.files.local_plan``). ``writers.formats.read_order`` lists those reads.
The views' trees are shapes only, so every rank builds the same ones and lists the same
reads, and from them the device tensors to gather (a shard, or one state of a shard, within
its sharding group). Every rank then gathers those in that order, in runs of
``coordination.runs_by_size`` with one sync each; the writing rank keeps the run it reads
from on its host. No rank waits for another's request: a read of a tensor that is not in a
run ahead of the writer raises instead of gathering out of turn, and a writer that stops
early gathers the rest without keeping it, so that every rank finishes its runs before the
save's agreement. With ``sharding_groups`` every group gathers the same list (the groups'
models are alike); the ranks check that they agree before the first gather.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..._sharding.names import join_name
from ..._unit.buffers import original_dtype
from ..coordination import exchange, gathered_bytes, gathered_on_host, runs_by_size
from ..files import CheckpointError, TensorRef
from ..files.reader import contiguous_strides
from ..metadata import (SHARD_METADATA, FORMAT_VERSION, RankRecord, ShardMetadata,
                        persistent_buffers, rank_file_tree, units_by_saved_path,
                        wrapping_fingerprint)
from ..optimizer_state import StateValue, live_state, optimizer_shard_keys, walk_state
from ..unit_protocol import ShardedModel
from .plan import SpreadTensor
from .shard_set import ShardSet


class Gathers:
    """The device tensors a save gathers, in the writer's read order (see [Note: every rank
    knows the writer's read order]), as one rank takes part in them."""

    def __init__(self, tensors: Dict[str, Tuple[torch.Tensor, Any]]) -> None:
        self._tensors = tensors          # id -> (device tensor, its unit's collectives)
        self._runs: List[List[str]] = []
        self._next = 0
        self._keep = False
        self._held: Dict[str, torch.Tensor] = {}

    def follow(self, reads: Sequence[Any], keep: bool) -> None:
        """Sets the order from the writer's ``reads``; ``keep`` on the writing rank. Every
        rank calls it, and raises if another lists other tensors."""
        order: List[str] = []
        for read in reads:
            # a SpreadTensor is read from the views; anything else is this rank's own
            if isinstance(read, SpreadTensor) and math.prod(read.shape) \
                    and (not order or order[-1] != read.shards[0].key):
                order.append(read.shards[0].key)
        # names and sizes: the sizes cut the runs, so every rank must see the same ones
        digest = hashlib.sha256(repr([(t, self._full_bytes(t)) for t in order]).encode()
                                ).hexdigest()
        if len(set(exchange("xla_fsdp.gathered.order", digest))) > 1:
            raise CheckpointError("the ranks would gather different tensors for the consolidated "
                                  "save; the sharding groups' models must be alike")
        self._runs = [list(dict.fromkeys(run)) for run in runs_by_size(order, self._full_bytes)]
        self._keep = keep

    def shard_bytes(self, tid: str) -> int:
        """The bytes of one rank's ``tid``."""
        tensor, _ = self._tensors[tid]
        return tensor.numel() * tensor.element_size()

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
        return dict(zip(run, gathered_on_host(on_device, self._keep)))

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


class _RankView:
    """Rank ``rank``'s part of the gathered tensors, read like a checkpoint file."""

    def __init__(self, gathers: Gathers, rank: int, world: int, tree: Any) -> None:
        self.path = f"<rank {rank}'s shards, over the collectives>"
        self._gathers, self._rank, self._world = gathers, rank, world
        self.tree = tree

    def record_size(self, key: str) -> int:
        return self._gathers.shard_bytes(key)

    def pread_into(self, key: str, byte_offset: int, out: Any) -> None:
        full = self._gathers.fetch(key).reshape(-1).view(torch.uint8)
        size = full.numel() // self._world
        view = memoryview(out).cast("B")
        start = self._rank * size + byte_offset
        view[:] = full[start:start + len(view)].numpy().tobytes()

    def verify(self) -> None:
        """Nothing stored, nothing to check."""

    def close(self) -> None:
        """The gathers are finished by ``gathered_shard_set``."""


class _LocalView:
    """Whole tensors this rank holds (buffers, ``step``): copied to the host, in the dtype
    they are saved in, when read; no collective."""

    def __init__(self, tensors: Dict[str, Tuple[torch.Tensor, torch.dtype]]) -> None:
        self.path = "<this rank's tensors>"
        self._tensors = tensors
        self.tree = None

    def record_size(self, key: str) -> int:
        tensor, dtype = self._tensors[key]
        return tensor.numel() * torch.empty((), dtype=dtype).element_size()

    def pread_into(self, key: str, byte_offset: int, out: Any) -> None:
        tensor, dtype = self._tensors[key]
        data = tensor.detach().cpu().to(dtype).contiguous().reshape(-1).view(torch.uint8)
        view = memoryview(out).cast("B")
        view[:] = data[byte_offset:byte_offset + len(view)].numpy().tobytes()


def _ref(file: Any, key: str, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None
         ) -> TensorRef:
    shape = tuple(tensor.shape)
    return TensorRef(file, key, dtype or tensor.dtype, 0, shape, contiguous_strides(shape))


def gathered_shard_set(model: ShardedModel, optimizer: Optional[torch.optim.Optimizer],
                       extra: Any = None) -> Tuple[ShardSet, Gathers]:
    """The ``ShardSet`` of ``model`` (and ``optimizer``) as ``save_sharded`` would have written
    it at this point, and the ``Gathers`` its views read through, on every rank. Every rank
    calls ``Gathers.follow`` with the same reads, and ``Gathers.finish`` at the end."""
    import torch_xla
    torch_xla.sync()
    metadata = model.get_shard_metadata()
    world = metadata["world_size"]
    tensors: Dict[str, Tuple[torch.Tensor, Any]] = {}
    shard_keys: List[str] = []   # model state dict keys, also the shards' tensor ids
    for path, unit in units_by_saved_path(model, model.named_units()):  # keys as saved
        for g in unit.shard_groups:
            key = join_name(path, g.shard_name)
            tensors[key] = (g.shard, unit.collectives)
            shard_keys.append(key)
    param_keys = optimizer_shard_keys(model, optimizer) if optimizer is not None else None
    state: List[StateValue] = []  # the optimizer's; sharded values gathered as "<key>#<name>"
    if optimizer is not None:
        params, by_index = live_state(optimizer)
        state = list(walk_state(by_index, lambda i: params[i].shape,
                                lambda i: f"consolidated save of {param_keys[i]}"))
        for s in state:
            if s.sharded:
                tensors[_state_id(param_keys, s)] = (s.value, tensors[param_keys[s.index]][1])
    gathers = Gathers(tensors)
    buffers = {name: (buf, original_dtype(buf)) for name, buf in persistent_buffers(model)}
    local = _LocalView(buffers)
    files = []
    for rank in range(world):
        view = _RankView(gathers, rank, world, None)
        model_tree = {k: _ref(view, k, tensors[k][0]) for k in shard_keys}
        if rank == 0:
            model_tree.update({n: _ref(local, n, b, d) for n, (b, d) in buffers.items()})
        view.tree = rank_file_tree(
            model_tree, dict(metadata, rank=rank),
            RankRecord(FORMAT_VERSION, world, rank, wrapping_fingerprint(metadata), 0,
                       param_keys),
            _optimizer_tree(optimizer, view, tensors, state, param_keys)
            if optimizer is not None else None, extra)
        files.append(view)
    return ShardSet(files, ShardMetadata(files[0].tree[SHARD_METADATA]), "<live model>"), gathers


def _state_id(param_keys: List[str], value: StateValue) -> str:
    return f"{param_keys[value.index]}#{value.name}"


def _optimizer_tree(optimizer: torch.optim.Optimizer, view: _RankView,
                    tensors: Dict[str, Tuple[torch.Tensor, Any]], state: List[StateValue],
                    param_keys: List[str]) -> Dict[str, Any]:
    """``optimizer.state_dict()``'s structure, sharded state as references into the gathered
    tensors, the rest (``step``) as this rank's copy: it is the same on every rank."""
    tree: Dict[int, Dict[str, Any]] = {}
    for s in state:
        tid = _state_id(param_keys, s)
        tree.setdefault(s.index, {})[s.name] = (_ref(view, tid, tensors[tid][0]) if s.sharded
                                                else _host(s.value))
    return {"state": tree, "param_groups": optimizer.state_dict()["param_groups"]}


def _host(value: Any) -> Any:
    if torch.is_tensor(value):
        return _ref(_LocalView({"v": (value, value.dtype)}), "v", value)
    return value
