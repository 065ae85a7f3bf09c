"""``checkpoint_module``: recompute a module's activations in backward instead of keeping them.

[Note: the recompute's barrier holds the module's weights]
torch_xla's ``checkpoint`` puts an optimization barrier before the recompute, over the
saved inputs, the incoming gradients and, when the function it runs is a method of a
module, that module's ``parameters()`` and ``buffers()``. The barrier stops XLA from
reading the weights for the recompute before backward reaches it, and from merging the
recompute into the forward, which would keep the activations after all. Inside an FSDP unit
a module's parameters are placeholders, plain attributes, which ``parameters()`` lists while
they hold their full values (see [Note: a module's parameters inside its unit]),
as the recompute in the unit's backward finds them: the barrier holds the same weights as
with torch_xla's FSDP, whose full parameters stay registered.
"""
from __future__ import annotations

from types import MethodType
from typing import Any

import torch
import torch.nn as nn


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Makes ``module.forward`` run under torch_xla's activation checkpointing.

    Use it inside the FSDP unit, e.g. as ``auto_wrapper_callable=lambda m, *a, **k:
    XlaFullyShardedDataParallel(checkpoint_module(m), *a, **k)``. Keyword arguments are passed
    through; when no input requires grad (e.g. under no_grad) nothing is checkpointed. The
    recompute's barrier holds the module's weights and buffers (see [Note: the recompute's
    barrier holds the module's weights])."""
    from torch_xla.utils.checkpoint import checkpoint

    original = module.forward

    def run_flat(_module: nn.Module, n_args: int, keys: tuple, *flat: Any) -> Any:
        # the recompute runs in the unit's backward, which holds the attention scope as its
        # forward did (see [Note: attention inside a unit keeps no probabilities])
        return original(*flat[:n_args], **dict(zip(keys, flat[n_args:])))

    recompute = MethodType(run_flat, module)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        flat = args + tuple(kwargs.values())
        if not any(getattr(t, "requires_grad", False) for t in flat):
            return original(*args, **kwargs)
        return checkpoint(recompute, len(args), tuple(kwargs), *flat)

    eager = torch.compiler.disable(forward)

    def forward_or_traced(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # torch_xla's checkpoint cannot run under Dynamo: it keeps the device RNG state as a
        # Python int, which Dynamo would bake into the graph and recompile for at every
        # step. Traced, the recompute is torch's checkpoint instead, which Dynamo turns into
        # recomputation inside the backward program; the module's weights are then the
        # graph's values, gathered by the traced path or given as the region's inputs.
        if torch.compiler.is_compiling():
            from torch.utils.checkpoint import checkpoint
            return checkpoint(original, *args, use_reentrant=False, **kwargs)
        return eager(self, *args, **kwargs)

    module._xla_checkpointed_forward_original = original
    module.forward = MethodType(forward_or_traced, module)
    return module
