"""``checkpoint_module``: recompute a module's activations in backward instead of keeping them."""
from __future__ import annotations

from types import MethodType

import torch.nn as nn


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Makes ``module.forward`` run under torch_xla's activation checkpointing.

    Use it inside the FSDP unit, e.g. as ``auto_wrapper_callable=lambda m, *a, **k:
    XlaFullyShardedDataParallel(checkpoint_module(m), *a, **k)``. Keyword arguments are passed
    through; when no input requires grad (e.g. under no_grad) nothing is checkpointed."""
    from torch_xla.utils.checkpoint import checkpoint

    original = module.forward

    def run_flat(n_args: int, keys: tuple, *flat):
        return original(*flat[:n_args], **dict(zip(keys, flat[n_args:])))

    def forward(self, *args, **kwargs):
        flat = args + tuple(kwargs.values())
        if not any(getattr(t, "requires_grad", False) for t in flat):
            return original(*args, **kwargs)
        return checkpoint(run_flat, len(args), tuple(kwargs), *flat)

    module._xla_checkpointed_forward_original = original
    module.forward = MethodType(forward, module)
    return module
