"""Fully Sharded Data Parallel (ZeRO-3) for PyTorch on XLA devices.

The public API: the wrapper (``XlaFullyShardedDataParallel``, also ``FSDP``), scanned layers,
``UnitModule`` (what both kinds of unit are, for ``isinstance``), auto-wrap policies,
``checkpoint_module``, ``allow_per_shard_statistics``, the launcher and ``patch_torch_xla()``;
``xla_fsdp.checkpoint`` for checkpoints. ARCHITECTURE.md describes the layers below them.
"""
from typing import Any

from .compat.patch import patch_torch_xla
from .launch import LaunchError, launch

__all__ = ["launch", "LaunchError", "patch_torch_xla", "XlaFullyShardedDataParallel", "FSDP",
           "ScannedLayers", "UnitModule", "checkpoint_module", "always_wrap_policy",
           "size_based_auto_wrap_policy", "transformer_auto_wrap_policy",
           "lambda_auto_wrap_policy", "recursive_wrap", "allow_per_shard_statistics"]
_WRAP = {"always_wrap_policy", "size_based_auto_wrap_policy", "transformer_auto_wrap_policy",
         "lambda_auto_wrap_policy", "recursive_wrap"}


def __getattr__(name: str) -> Any:
    # the wrapper imports torch; keep `from xla_fsdp import launch` light
    if name in ("XlaFullyShardedDataParallel", "FSDP"):
        from .fully_sharded import XlaFullyShardedDataParallel as value
    elif name == "ScannedLayers":
        from .scanned_layers import ScannedLayers as value
    elif name == "UnitModule":
        from .unit_module import UnitModule as value
    elif name == "checkpoint_module":
        from .activation_checkpoint import checkpoint_module as value
    elif name == "allow_per_shard_statistics":
        from ._unit.optimizer_guard import allow_per_shard_statistics as value
    elif name in _WRAP:
        from . import wrap
        value = getattr(wrap, name)
    else:
        raise AttributeError(f"module 'xla_fsdp' has no attribute {name!r}")
    globals()[name] = value
    return value
