"""Consolidation called from Python: torch_xla's ``consolidate_sharded_model_checkpoints``
and ``consolidate_sharded_state_dicts``, on the same streaming reader and writer as the
command line tool.

Training code calls these right after its own save, often on one rank while the others are
still writing (``xm.save`` no longer waits for the other ranks in torch_xla 2.9), so reading
files waits, up to a timeout, until the set is complete and from one save.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..formats.consolidated import optimizer_companion
from ..files import CheckpointError
from ..files.memory import InMemoryCheckpoint
from ..formats.per_rank import SHARD_METADATA, ShardMetadata
from ..formats.keys import MODEL
from ..writers.formats import OutputOptions, write_output
from ..per_rank.optimizer import optimizer_param_keys
from ..per_rank.plan import ModelPlan, plan_model
from ..per_rank.unwrapped import unwrapped_state
from ..per_rank.shard_set import ShardSet, check_shard_set, wait_for_shard_set

DEFAULT_WAIT_SECONDS = 600.0


def consolidate_checkpoint_files(ckpt_prefix: str, ckpt_suffix: str = "*.pth",
                                 save_path: str = "", save_model: bool = True,
                                 wait_seconds: float = DEFAULT_WAIT_SECONDS
                                 ) -> Tuple["OrderedDict[str, torch.Tensor]", Optional[str]]:
    """The unwrapped model's state dict from the per-rank files ``ckpt_prefix +
    ckpt_suffix``, and the path it was saved to (None unless ``save_model``).

    The saved file is ``{'model': ..., 'optimizer': ..., 'optimizer_param_names': ...}``
    (the optimizer when its parameter mapping is known), written atomically and verified.
    A file matching the pattern that is the output itself is not read as an input."""
    out = output_paths("pt", save_path, ckpt_prefix)[0] if save_model else None
    shards = wait_for_shard_set(ckpt_prefix, ckpt_suffix, [out] if out else [], wait_seconds)
    with contextlib.closing(shards):
        plan = plan_model(shards)
        if out is None:
            return _state_dict(plan, shards), None
        with_optimizer = optimizer_param_keys(shards, plan)[1] is None
        write_output(unwrapped_state(shards, plan, with_optimizer), "pt", out, OutputOptions(),
                     lambda _: None)
    saved = torch.load(out, map_location="cpu", mmap=True, weights_only=True)
    print(f"saved consolidated model to {out}")
    return OrderedDict(saved[MODEL]), out


def consolidate_state_dicts(state_dict_list: List[Dict[str, Any]],
                            shard_metadata: Dict[str, Any]) -> "OrderedDict[str, torch.Tensor]":
    """The unwrapped model's state dict from every rank's ``model.state_dict()``, in rank
    order, and any rank's ``get_shard_metadata()``."""
    metadata = ShardMetadata(shard_metadata)
    world = metadata.world_size
    if len(state_dict_list) != world:
        raise CheckpointError(f"got {len(state_dict_list)} state dicts for a world of {world}; "
                              f"pass every rank's, in rank order")
    files = [InMemoryCheckpoint({MODEL: sd, SHARD_METADATA: dict(shard_metadata, rank=r)},
                                f"<state dict of rank {r}>")
             for r, sd in enumerate(state_dict_list)]
    shards = ShardSet(check_shard_set(files, "the state dicts"), metadata, "")
    plan = plan_model(shards)
    return _state_dict(plan, shards)


def _state_dict(plan: ModelPlan, shards: ShardSet) -> "OrderedDict[str, torch.Tensor]":
    state = unwrapped_state(shards, plan, False)
    return state.with_aliases(OrderedDict(state.entries()))  # tied: one tensor, both names


def output_paths(fmt: str, save_path: str, prefix: str) -> List[str]:
    """What a consolidation of the files at ``prefix`` in ``fmt`` writes (the first is the
    model's), unless ``save_path`` names it."""
    if fmt in ("dcp", "hf"):
        return [save_path or f"{prefix}_{fmt}"]
    if fmt == "safetensors":
        path = save_path or f"{prefix}_consolidated.safetensors"
        return [path, optimizer_companion(path)]
    return [save_path or f"{prefix}_consolidated.pth"]
