"""Fully Sharded Data Parallel (ZeRO-3) for PyTorch on XLA devices."""
from .launch import LaunchError, launch
from .patch import patch_torch_xla

_LAZY = {
    "XlaFullyShardedDataParallel": "fully_sharded", "FSDP": "fully_sharded",
    "checkpoint_module": "activation_checkpoint", "ScannedLayers": "scanned_layers",
    "always_wrap_policy": "wrap", "size_based_auto_wrap_policy": "wrap",
    "transformer_auto_wrap_policy": "wrap", "lambda_auto_wrap_policy": "wrap",
    "recursive_wrap": "wrap",
}

__all__ = ["launch", "LaunchError", "patch_torch_xla", *_LAZY]


def __getattr__(name):
    # The wrapper imports torch_xla; keep `from xla_fsdp import launch` light.
    if name in _LAZY:
        import importlib
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        value = getattr(module, "XlaFullyShardedDataParallel" if name == "FSDP" else name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'xla_fsdp' has no attribute {name!r}")
