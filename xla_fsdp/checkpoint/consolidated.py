"""Consolidated checkpoints from training code: ``save_consolidated`` and ``load_consolidated``.

One rank writes the unwrapped model's checkpoint (``.pth``, safetensors, a Hugging Face
directory or DCP) while the shards come to it over the collectives, every rank gathering in
the order the writer reads (see [Note: every rank knows the writer's read order]): no
per-rank files, so no filesystem shared between hosts, and the writer's host holds one
run of gathers (``coordination.runs_by_size``) at a time.
Loading reads any of those formats back at any world size, each rank its own runs, or the
first rank alone when only its host has the checkpoint (``sources``).
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

import torch

from .._xla.trace_only import refuse_reads
from .coordination import agree, every_rank_agrees
from .staging import Source, load_staged
from .gathered_state import gathered_state
from .writers.formats import FORMATS, OutputOptions, write_output
from .writers.hf_directory import DEFAULT_MAX_SHARD_SIZE
from .live_model import (refuse_lost_writes, require_root, sharding_group_load_path,
                         sharding_group_path, writes_sharding_group_copy)
from .sources.consolidated_files import open_consolidated
from .sources.first_rank import FirstRankSource
from .unit_protocol import ShardedModel


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
    path, _ = sharding_group_path(path, model)
    writes = model.rank == 0 and writes_sharding_group_copy(model)
    written: Optional[List[str]] = None
    # on every rank: the states are alike, so all refuse together or none does
    with every_rank_agrees("xla_fsdp.save_consolidated.plan"):
        refuse_lost_writes(model)
        # hf writes the model only
        state, gathers = gathered_state(model, optimizer if format != "hf" else None, extra)
        reads = state.read_order(aliases_again=format == "dcp")
    gathers.follow(reads, keep=writes)   # raises on every rank alike
    error: Optional[BaseException] = None
    try:
        try:
            if writes:
                options = OutputOptions(dcp_keys, hf_config, max_shard_size,
                                        model.wrapped_module)
                written, _ = write_output(state, format, path, options, lambda _: None)
        except Exception as exc:  # every rank raises it, below
            error = exc
        try:
            gathers.finish()  # the runs the writer did not read (on the others, every run)
        except Exception as exc:
            error = error or exc
        agree("xla_fsdp.save_consolidated", error)
    finally:
        error = None  # see [Note: no frame keeps the exception it raises]
    return written


def load_consolidated(path: str, model: ShardedModel,
                      optimizer: Optional[torch.optim.Optimizer] = None, *,
                      first_rank_reads: bool = False) -> Any:
    """Loads a consolidated checkpoint into ``model`` (and ``optimizer``) at any world size:
    what ``save_consolidated`` or ``consolidate_sharded_ckpts`` wrote in any format (``.pth``,
    ``.safetensors`` with its ``.optimizer.pth``, a Hugging Face directory, DCP), or a bare
    ``torch.save(state_dict)``. Returns the ``extra`` saved with it, if any. Every rank calls
    it.

    Each rank reads only the runs of the tensors its shards hold (see [Note: a rank reads the
    runs its shards hold]). With ``first_rank_reads`` only global rank 0 opens ``path`` (the
    others may pass anything) and the others receive their shards over the collectives
    (see [Note: the first rank reads, everyone receives a stream]): a checkpoint only host 0
    has. A checkpoint that does not fit raises ``CheckpointError``, naming the key or file,
    on every rank, and changes nothing."""
    import torch_xla.runtime as xr
    require_root(model, "load_consolidated")
    refuse_reads(path)
    independent = sharding_group_path(path, model)[1]
    path = sharding_group_load_path(path, model, os.path.exists)

    def opened(crc_share: Optional[Tuple[int, int]] = (0, 1)) -> Source:
        return open_consolidated(path, crc_share=crc_share,
                                 optimizer_wanted=optimizer is not None)

    if not first_rank_reads:
        # the ranks of a sharding group open one file: each checks its share of the CRCs
        share = (model.rank, model.world_size)
        return load_staged(lambda: opened(share), model, optimizer,
                           "xla_fsdp.load_consolidated").extra
    if independent:
        raise ValueError("load_consolidated(first_rank_reads=True) cannot load independent "
                         "sharding_groups (each group has a checkpoint of its own); load with "
                         "first_rank_reads=False from storage each group's ranks can read")
    pin = model.options.pin_layout_in_collective_ops
    return load_staged(lambda: FirstRankSource(opened, xr.global_ordinal(), pin,
                                               "xla_fsdp.load_consolidated.first_rank"),
                       model, optimizer, "xla_fsdp.load_consolidated").extra
