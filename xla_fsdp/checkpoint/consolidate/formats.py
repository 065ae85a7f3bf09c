"""One consolidated output of each format from a ``ShardSet`` (per-rank files, or a live
model's shards over the collectives), written and then verified: what the command line tool
and ``save_consolidated`` share."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

from ..dcp.layout import key_scheme
from .dcp_output import verify_dcp, write_dcp
from .hf_output import DEFAULT_MAX_SHARD_SIZE, hf_directory
from .output import entry_specs, model_entries, verify_output, write_consolidated
from .plan import ModelPlan
from .shard_set import ShardSet

FORMATS = ("pt", "safetensors", "hf", "dcp")


@dataclass(frozen=True)
class OutputOptions:
    dcp_keys: str = "get_state_dict"
    hf_config: str = ""                       # a config.json or the directory holding it
    max_shard_size: Any = DEFAULT_MAX_SHARD_SIZE
    model: Optional[torch.nn.Module] = None   # the unwrapped model, for its own HF config


def output_paths(fmt: str, save_path: str, prefix: str) -> List[str]:
    """What a consolidation in ``fmt`` writes (the first is the model's)."""
    if fmt in ("dcp", "hf"):
        return [save_path or f"{prefix}_{fmt}"]
    path = save_path or prefix + "_consolidated" + (".safetensors" if fmt == "safetensors"
                                                    else ".pth")
    if fmt == "safetensors":
        return [path, os.path.splitext(path)[0] + ".optimizer.pth"]
    return [path]


def write_output(shards: ShardSet, plan: ModelPlan, fmt: str, path: str, with_optimizer: bool,
                 options: OutputOptions, progress: Callable[[int], None]
                 ) -> Tuple[List[str], str]:
    """Writes and verifies; returns the paths written and what was verified."""
    specs = {n: (d, s) for n, d, s in entry_specs(plan, shards)}
    if fmt == "hf":
        written, summary = hf_directory(path, entry_specs(plan, shards),
                                        model_entries(plan, shards), plan.aliases,
                                        options.hf_config, options.model,
                                        options.max_shard_size, progress)
        return written, summary + " in the Hugging Face layout (model weights only)"
    if fmt == "dcp":
        scheme = key_scheme(options.dcp_keys)
        written = write_dcp(shards, plan, path, with_optimizer, scheme, progress)
        return written, verify_dcp(written[0], specs, with_optimizer, scheme)
    written = write_consolidated(shards, plan, path, fmt, with_optimizer, progress)
    return written, (verify_output(written[0], specs, fmt)
                     + (", optimizer included" if with_optimizer else ""))
