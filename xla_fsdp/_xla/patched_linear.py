"""``nn.Linear`` whose backward reads the weight itself, not a saved transpose.

PyTorch/XLA's traced ``linear`` backward keeps an intermediate derived from the weight
alive from forward to backward (pytorch/xla#3811). Under FSDP that intermediate is a full
parameter that survives resharding, which defeats ``reshard_after_forward``. This autograd
function saves the weight tensor, which FSDP frees and re-gathers, instead.

[Note: the patched linear under autocast]
An autograd function runs its forward with autocast still on, and its backward in the
engine's thread, where autocast is off. Under ``torch.autocast("xla", dtype=bf16)`` the
stock ``linear`` casts its input, weight and bias to bf16 and its backward computes in bf16;
this one computed its backward from a bf16 gradient and the float32 weight, which XLA's
verifier refuses. So under autocast it casts as autocast would, in both directions, and
still saves the weight it was given (cast again in backward), not a bf16 copy of it.
"""
from __future__ import annotations

from types import MethodType

import torch


def _cast(t, dtype):
    return t if t is None or dtype is None or not t.is_floating_point() else t.to(dtype)


class LinearReadingWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias=None, dtype=None):
        """``dtype``: autocast's, when it is on (see [Note: the patched linear under
        autocast]); the gradients leave in the inputs' own dtypes (autograd casts them)."""
        x = _cast(input, dtype)
        ctx.save_for_backward(x, weight, bias)
        ctx.autocast_to = dtype
        with torch.no_grad():
            if dtype is None:
                return torch.nn.functional.linear(x, weight, bias)
            with torch.autocast("xla", enabled=False):
                return torch.nn.functional.linear(x, _cast(weight, dtype), _cast(bias, dtype))

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, bias = ctx.saved_tensors
        rows_out = _cast(grad_output, ctx.autocast_to).reshape(-1, grad_output.shape[-1])
        rows_in = x.reshape(-1, x.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = rows_out.mm(_cast(weight, ctx.autocast_to)).view(*x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = rows_out.t().mm(rows_in)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = rows_out.sum(0)
        return grad_x, grad_w, grad_b, None


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # AOTAutograd derives a compiled region's backward itself and saves what its
        # partitioner picks. Traced, this function's saved input is a view of a region
        # input, which torch_xla's bridge (matching outputs to inputs by identity) would
        # expect back from the graph and not get.
        return torch.nn.functional.linear(x, module.weight, module.bias)
    dtype = torch.get_autocast_dtype("xla") if torch.is_autocast_enabled("xla") else None
    return LinearReadingWeight.apply(x, module.weight, module.bias, dtype)


def computes_as_torch(module: torch.nn.Module, cls: type) -> bool:
    """Whether ``module`` is a ``cls`` whose forward is ``cls``'s own: no subclass forward,
    none set on the instance but the weight-reading one above."""
    if not isinstance(module, cls) or type(module).forward is not cls.forward:
        return False
    own = vars(module).get("forward")
    return own is None or getattr(own, "__func__", None) is _forward


def patch_linear_layers(module: torch.nn.Module) -> None:
    """Gives every ``nn.Linear`` in ``module`` that still uses the stock forward the
    weight-reading backward. Layers with a custom forward are left alone."""
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and \
                getattr(m.forward, "__func__", None) is torch.nn.Linear.forward:
            m.forward = MethodType(_forward, m)
