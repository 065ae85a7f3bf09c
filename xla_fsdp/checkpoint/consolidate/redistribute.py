"""A checkpoint rewritten for another number of ranks (the CLI's ``--reshard N``).

No arithmetic of its own: the old rank files are read as the loader's source
(``sources.per_rank_files``), and each new rank's shard of a group is filled with the chunks the
group's layout at the new world size says that rank holds (``Layout.owned``, as
``live_model.ParamSlot`` gives a live model's), read from the source as ``load_sharded``
reads them into a live model at that world size. The new files are in ``save_sharded``'s
format (the shard metadata and our record as a save at the new world size writes them), so
``load_sharded`` there takes them as its own. Memory stays near one new shard: each is
written (``TorchFileWriter``) as soon as it is read, every new rank's file open at once.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Dict, List, Sequence

import torch

from ..._sharding.chunks import TensorPieces, run_chunks
from ..._sharding.layout import Layout
from ..formats.dcp.layout import GET_STATE_DICT
from ..staging import Source
from ..files import CheckpointError, TorchFileWriter
from ..files.reader import materialized
from ..formats.per_rank import RankRecord, rank_file_tree, wrapping_fingerprint
from ..optimizer_state import walk_state
from ..per_rank.optimizer import optimizer_param_keys
from ..sources.per_rank_files import shard_set_source
from ..per_rank.plan import ModelPlan, ShardGroupSpec
from ..per_rank.shard_set import ShardSet
from ..formats.keys import EXTRA, MODEL, OPTIMIZER


def read_shard(source: Source, keys: Sequence[str], spec: ShardGroupSpec, layout: Layout,
               rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s shard of ``spec`` laid out as ``layout``: the chunks of each of the
    group's tensors (stored under ``keys``, one per parameter of ``spec``) it holds, read
    from ``source``; padding is zeros, as in a saved shard."""
    shard = torch.zeros(tuple(layout.shard_shape), dtype=dtype)
    flat = shard.view(-1)
    wanted: Dict[str, TensorPieces] = {}
    for owned in layout.owned(rank):
        shape = spec.params[owned.param].shape
        chunks = run_chunks(shape, owned.start, owned.end, owned.shard_offset)
        wanted[keys[owned.param]] = TensorPieces(torch.Size(shape), dtype, chunks, lambda: flat)
    source.read(wanted, {}, {})
    return shard


def redistribute(shards: ShardSet, plan: ModelPlan, world_size: int, paths: List[str],
                 with_optimizer: bool, progress: Callable[[int], None]) -> None:
    """Writes ``paths[r]`` for every new rank ``r``; each loads with ``load_sharded`` into the
    same model wrapped at ``world_size`` ranks as its own rank's file."""
    record = RankRecord.of(shards.files[0].tree)
    if record is None or not shards.metadata.has_layouts:
        raise CheckpointError(
            f"{shards.files[0].path} was not written by xla_fsdp.checkpoint.save_sharded, so its "
            f"shard layouts are unknown and it cannot be rewritten for another world size; "
            f"consolidate it, or load it with load_sharded, which reads it at any world size")
    head = shards.files[0].tree
    source = shard_set_source(shards, plan, with_optimizer)
    writers = [TorchFileWriter(p) for p in paths]
    models: List[Dict[str, Any]] = [{} for _ in paths]
    for key in plan.buffers:  # not sharded: every rank's file holds rank 0's, as saved
        tensor = head[MODEL][key].read()
        for r, writer in enumerate(writers):
            models[r][key] = writer.add(tensor)
        progress(tensor.numel())
    for spec in plan.shard_groups:
        layout = spec.layout(world_size)
        keys = [GET_STATE_DICT.model(p.name)[0] for p in spec.params]
        dtype = head[MODEL][spec.key].dtype
        for r, writer in enumerate(writers):
            models[r][spec.key] = writer.add(read_shard(source, keys, spec, layout, r, dtype))
        progress(spec.numel)
    optimizers = _optimizer_states(shards, plan, source, writers) if with_optimizer else None
    extra = materialized(head[EXTRA]) if EXTRA in head else None  # as the source reads it
    for r, writer in enumerate(writers):
        metadata = shards.metadata.for_rank(world_size, r)
        ours = dataclasses.replace(
            record, world_size=world_size, rank=r, fingerprint=wrapping_fingerprint(metadata),
            optimizer_param_keys=record.optimizer_param_keys if with_optimizer else None)
        writer.finish(rank_file_tree(
            models[r], metadata, ours,
            {"state": optimizers[r], "param_groups": copy.deepcopy(
                head[OPTIMIZER]["param_groups"])} if optimizers is not None else None, extra))


def _optimizer_states(shards: ShardSet, plan: ModelPlan, source: Source,
                      writers: List[TorchFileWriter]) -> List[Dict[int, Any]]:
    """Every new rank's optimizer state by index (the indices stay: they number the same
    shards). State sharded like its shard is read as the shard is; the rest is rank 0's."""
    keys = optimizer_param_keys(shards, plan)[0] or []
    specs = plan.spec_of()
    head = shards.files[0].tree
    out: List[Dict[int, Any]] = [{} for _ in writers]
    where = shards.files[0].path
    for s in walk_state(head[OPTIMIZER]["state"], lambda i: head[MODEL][specs[keys[i]].key].shape,
                        lambda i: f"{where}, optimizer index {i}"):
        spec = specs[keys[s.index]]
        if s.sharded:
            state_keys = [GET_STATE_DICT.state(p.name, s.name)[0] for p in spec.params]
            layout = spec.layout(len(writers))
            for r, writer in enumerate(writers):
                piece = read_shard(source, state_keys, spec, layout, r, s.value.dtype)
                out[r].setdefault(s.index, {})[s.name] = writer.add(piece)
        else:
            value = materialized(s.value)
            for r, writer in enumerate(writers):
                out[r].setdefault(s.index, {})[s.name] = (
                    writer.add(value) if isinstance(value, torch.Tensor) else value)
    return out
