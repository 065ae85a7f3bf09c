"""One consolidated output of each format from an ``UnwrappedState`` (read from per-rank
files, or gathered from a live model), written and then verified: what the command line tool,
``save_consolidated`` and torch_xla's ``consolidate_sharded_model_checkpoints`` share.

What was written is verified in one way for every format (``verify_written``): it is opened
as ``load_consolidated`` opens it (``sources.consolidated_files``, which reads each format's
headers, index or ``.metadata``), and what that finds under the model's keys must be what the
writer meant to store, names, dtypes and shapes, nothing more; the optimizer's param groups
must be there when it was written, and a ``torch.save`` file's records must match their
CRC-32s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..formats.dcp.layout import GET_STATE_DICT, KeyScheme, key_scheme
from ..files import CheckpointError, CheckpointFile
from ..sources.consolidated_files import open_consolidated
from .dcp_directory import write_dcp
from .hf_directory import DEFAULT_MAX_SHARD_SIZE, hf_directory
from .consolidated_file import write_consolidated
from ..formats.keys import EXTRA, OPTIMIZER
from ..unwrapped_state import UnwrappedState

FORMATS = ("pt", "safetensors", "hf", "dcp")
Expected = Dict[str, Tuple[torch.dtype, Tuple[int, ...]]]  # model entry -> dtype, shape


@dataclass(frozen=True)
class OutputOptions:
    dcp_keys: str = "get_state_dict"
    hf_config: str = ""                       # a config.json or the directory holding it
    max_shard_size: Any = DEFAULT_MAX_SHARD_SIZE
    model: Optional[torch.nn.Module] = None   # the unwrapped model, for its own HF config



def write_output(state: UnwrappedState, fmt: str, path: str, options: OutputOptions,
                 progress: Callable[[int], None]) -> Tuple[List[str], str]:
    """Writes ``state`` (with the optimizer when it has it; an HF directory never does) and
    verifies it; returns the paths written and what was verified. A writer reads the state
    in ``UnwrappedState.read_order``, DCP's with each tied alias again (it stores each under
    its own key); a live model's gathers follow it (see [Note: every rank knows the writer's
    read order])."""
    specs = {n: (d, tuple(s)) for n, d, s in state.specs()}
    scheme, layout = GET_STATE_DICT, ""
    with_optimizer = state.optimizer is not None
    if fmt == "hf":
        written, specs = hf_directory(path, state.specs(), state.entries(), state.aliases,
                                      options.hf_config, options.model,
                                      options.max_shard_size, progress)
        layout = " in the Hugging Face layout (model weights only)"
        with_optimizer = False
    elif fmt == "dcp":
        scheme = key_scheme(options.dcp_keys)
        written = write_dcp(state, path, scheme, progress)
        layout = f" under {scheme.name}'s keys"
    else:
        written = write_consolidated(state, path, fmt, progress)
    summary = verify_written(fmt, written, specs, with_optimizer, scheme) + layout
    return written, summary + (", optimizer included" if with_optimizer else "")


def verify_written(fmt: str, written: Sequence[str], expected: Expected, with_optimizer: bool,
                   scheme: KeyScheme = GET_STATE_DICT) -> str:
    """Re-reads what was written in ``fmt`` (``written[0]`` the checkpoint, a file after it
    beside it) as the loader opens it: every ``expected`` model entry with its dtype and
    shape under ``scheme``'s keys, and no other; the optimizer's param groups when
    ``with_optimizer``; the CRC-32s of every ``torch.save`` file and of every tensor of a
    safetensors file. Returns what was verified."""
    for path in written if fmt == "pt" else []:
        with CheckpointFile(path) as f:
            f.verify()
    source = open_consolidated(written[0], safetensors=fmt == "safetensors",
                               crc_share=None if fmt == "pt" else (0, 1))
    try:
        stored = dict(source.stored)
    finally:
        source.close()
    got = {k: (v.properties.dtype, tuple(v.size)) if isinstance(v, TensorStorageMetadata)
           else "an object" for k, v in stored.items()
           if not k.startswith(OPTIMIZER + ".") and k != EXTRA}
    want = {scheme.model(n)[0]: (d, tuple(s)) for n, (d, s) in expected.items()}
    problems = []
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(f"{k}: {got[k]}, not {want[k]}"
                       for k in set(got) & set(want) if got[k] != want[k])
        problems.append(f"missing {missing}, unexpected {extra}, wrong shape or dtype {wrong}")
    if with_optimizer and not any(k.startswith(f"{OPTIMIZER}.param_groups.") for k in stored):
        problems.append("no optimizer param groups")
    if problems:
        raise CheckpointError(f"{written[0]} does not hold what was written: "
                              f"{'; '.join(problems)}")
    numel = sum(math.prod(s) for _, s in expected.values())
    return f"{len(expected)} tensors, {numel:,} elements"
