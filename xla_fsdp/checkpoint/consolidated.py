"""Consolidated checkpoints written from training code: ``save_consolidated``.

One rank writes the unwrapped model's checkpoint (``.pth``, safetensors, a Hugging Face
directory or DCP) while the shards come to it over the collectives, one device tensor at a
time (see [Note: the writer drives the collectives]): no per-rank files, so no filesystem
shared between hosts, and the writer's host holds one shard group's full size at a time.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from .dcp.coordination import agree
from .consolidate.formats import FORMATS, OutputOptions, write_output
from .consolidate.gathered import gathered_shard_set
from .consolidate.hf_output import DEFAULT_MAX_SHARD_SIZE
from .consolidate.optimizer import why_not_consolidated
from .consolidate.plan import plan_model
from .files import CheckpointError
from .metadata import MODEL
from .unit_protocol import ShardedModel, require_root, sharding_group_index


def save_consolidated(path: str, model: ShardedModel,
                      optimizer: Optional[torch.optim.Optimizer] = None, *,
                      format: str = "pt", extra: Any = None, hf_config: str = "",
                      max_shard_size: Any = DEFAULT_MAX_SHARD_SIZE,
                      dcp_keys: str = "get_state_dict") -> Optional[List[str]]:
    """Every rank calls it; the first rank of each sharding group that writes (see
    ``save_sharded``) writes ``path`` as ``consolidate_sharded_ckpts --format <format>``
    would from per-rank files, and gets the paths written; the others get None.

    ``hf`` writes the model only, with the unwrapped model's own ``config`` unless
    ``hf_config`` names one; ``pt``, ``safetensors`` and ``dcp`` include the optimizer.
    A failure on the writing rank raises on every rank."""
    require_root(model, "save_consolidated")
    if format not in FORMATS:
        raise ValueError(f"save_consolidated: format {format!r} is not one of {FORMATS}")
    index = sharding_group_index(model)
    replicas = index is not None and model.options.replicate_across_groups
    writes = model.rank == 0 and (not replicas or index == 0)
    if index is not None and not replicas:
        path = f"{path}_group-{index:03d}"
    written: Optional[List[str]] = None
    error: Optional[BaseException] = None
    with gathered_shard_set(model, optimizer, writes, extra) as shards:
        if shards is not None:
            try:
                plan = plan_model(shards.metadata, shards.files[0].tree[MODEL])
                reason = why_not_consolidated(shards, plan) if optimizer is not None else None
                if reason is not None:
                    raise CheckpointError(f"save_consolidated: the optimizer cannot be "
                                          f"consolidated: {reason}")
                options = OutputOptions(dcp_keys, hf_config, max_shard_size, model.wrapped_module)
                written, _ = write_output(shards, plan, format, path,
                                          optimizer is not None and format != "hf",
                                          options, lambda _: None)
            except Exception as exc:  # every rank raises it, below
                error = exc
    agree("xla_fsdp.save_consolidated", error)
    return written
