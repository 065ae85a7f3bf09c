"""The per-rank checkpoint of a live model, read over the collectives instead of from files:
consolidation from training code on pods whose hosts share no filesystem.

``gathered_shard_set`` gives the writing rank a ``ShardSet`` whose rank files are views of
the other ranks' device tensors. Every consolidated output (``.pth``, safetensors, HF
directory, DCP) then runs on it unchanged; no rank opens a file of another.

[Note: the writer drives the collectives]
The writers read tensors in orders of their own (parameter order, optimizer state after
the model, DCP's plan). Rather than fix an order every rank could follow, the writing rank
asks: each read of a device tensor not in hand is a round in which every rank learns, over
``xm.rendezvous``, which tensor comes next, and all of them all-gather it (a shard, or a
piece of optimizer state, within its sharding group). The other ranks loop on rounds until
the writer says it is done. The writer keeps the last tensor gathered (every rank's shard
of it) and nothing else, so its host holds one shard group's full size at a time, and a
parameter read from several ranks' "files" costs one gather. So the writers read the
optimizer state state by state across the parameters of a shard (``NamedState.in_read_order``): a
flat shard of nine parameters costs one gather per state, not nine. With ``sharding_groups``
every group's writer reads the same tensors in the same order (the groups are alike), so
a round names one tensor for all of them; they are checked to agree.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ..._sharding.names import join_name
from ..._unit.buffers import original_dtype
from ..coordination import exchange
from ..files import CheckpointError, TensorRef
from ..files.reader import contiguous_strides
from ..metadata import (SHARD_METADATA, FORMAT_VERSION, RankRecord, ShardMetadata,
                        persistent_buffers, rank_file_tree, units_by_saved_path,
                        wrapping_fingerprint)
from ..optimizer_state import StateValue, live_state, optimizer_shard_keys, walk_state
from ..unit_protocol import ShardedModel
from .shard_set import ShardSet

_DONE = "done"


class _Channel:
    """The rounds (see [Note: the writer drives the collectives]) as one rank sees them."""

    def __init__(self, tensors: Dict[str, Tuple[torch.Tensor, Any]], writes: bool) -> None:
        self._tensors = tensors          # id -> (device tensor, its unit's collectives)
        self._writes = writes
        self._rounds = 0
        self._held: Optional[Tuple[str, torch.Tensor]] = None

    def _round(self, request: Optional[str]) -> Optional[str]:
        self._rounds += 1
        asked = {r for r in exchange(f"xla_fsdp.gathered.{self._rounds}", request)
                 if r is not None}
        if len(asked) > 1:
            raise CheckpointError(f"the sharding groups' writers asked for different tensors "
                                  f"({sorted(asked)}); their models must be alike")
        return asked.pop() if asked else None

    def _gather(self, tid: str) -> torch.Tensor:
        import torch_xla
        tensor, collectives = self._tensors[tid]
        if tensor.device.type != "xla":  # offloaded: the shard and its state on the host
            tensor = tensor.to(torch_xla.device())
        (full,) = collectives.all_gather([tensor.detach()], coalesce=False)
        torch_xla.sync()
        return full.cpu() if self._writes else full

    def fetch(self, tid: str) -> torch.Tensor:
        """Every rank's ``tid`` concatenated in rank order, on this (writing) rank's host."""
        if self._held is None or self._held[0] != tid:
            self._held = None  # dropped before the next is gathered
            self._held = (tid, self._gather(self._round(tid)))
        return self._held[1]

    def serve(self) -> None:
        """Takes part in rounds until the writers are done (the ranks that do not write)."""
        while True:
            tid = self._round(None)
            if tid == _DONE:
                return
            if tid is None:
                raise CheckpointError("a consolidation round named no tensor")
            self._gather(tid)

    def finish(self) -> None:
        self._held = None
        if self._round(_DONE) != _DONE:
            raise CheckpointError("the writers did not finish together")


class _RankView:
    """Rank ``rank``'s part of the gathered tensors, read like a checkpoint file."""

    def __init__(self, channel: _Channel, rank: int, world: int, tree: Any) -> None:
        self.path = f"<rank {rank}'s shards, over the collectives>"
        self._channel, self._rank, self._world = channel, rank, world
        self.tree = tree

    def record_size(self, key: str) -> int:
        tensor, _ = self._channel._tensors[key]
        return tensor.numel() * tensor.element_size()

    def pread_into(self, key: str, byte_offset: int, out: Any) -> None:
        full = self._channel.fetch(key).reshape(-1).view(torch.uint8)
        size = full.numel() // self._world
        view = memoryview(out).cast("B")
        start = self._rank * size + byte_offset
        view[:] = full[start:start + len(view)].numpy().tobytes()

    def verify(self) -> None:
        """Nothing stored, nothing to check."""

    def close(self) -> None:
        """The channel is closed by ``gathered_shard_set``."""


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


@contextlib.contextmanager
def gathered_shard_set(model: ShardedModel, optimizer: Optional[torch.optim.Optimizer],
                       writes: bool, extra: Any = None) -> Iterator[Optional[ShardSet]]:
    """On a writing rank, the ``ShardSet`` of ``model`` (and ``optimizer``) as ``save_sharded``
    would have written it at this point; on the others, None, after serving the writers'
    rounds. Every rank must enter it; the writers' body runs the output."""
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
        # on every rank, before any serves: they refuse together
        params, by_index = live_state(optimizer)
        state = list(walk_state(by_index, lambda i: params[i].shape,
                                lambda i: f"consolidated save of {param_keys[i]}"))
        for s in state:
            if s.sharded:
                tensors[_state_id(param_keys, s)] = (s.value, tensors[param_keys[s.index]][1])
    channel = _Channel(tensors, writes)
    if not writes:
        channel.serve()
        yield None
        return
    buffers = {name: (buf, original_dtype(buf)) for name, buf in persistent_buffers(model)}
    local = _LocalView(buffers)
    files = []
    for rank in range(world):
        view = _RankView(channel, rank, world, None)
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
    try:
        yield ShardSet(files, ShardMetadata(files[0].tree[SHARD_METADATA]), "<live model>")
    finally:
        channel.finish()


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
