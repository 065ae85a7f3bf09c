"""``nn.Linear`` whose backward reads the weight itself, not a saved transpose.

PyTorch/XLA's traced ``linear`` backward keeps an intermediate derived from the weight
alive from forward to backward (pytorch/xla#3811). Under FSDP that intermediate is a full
parameter that survives resharding, which defeats ``reshard_after_forward``. This autograd
function saves the weight tensor, which FSDP frees and re-gathers, instead.
"""
from __future__ import annotations

from types import MethodType

import torch


class LinearReadingWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight, bias)
        with torch.no_grad():
            return torch.nn.functional.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, bias = ctx.saved_tensors
        rows_out = grad_output.reshape(-1, grad_output.shape[-1])
        rows_in = x.reshape(-1, x.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = rows_out.mm(weight).view(*x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = rows_out.t().mm(rows_in)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = rows_out.sum(0)
        return grad_x, grad_w, grad_b


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # AOTAutograd derives a compiled region's backward itself and saves what its
        # partitioner picks. Traced, this function's saved input is a view of a region
        # input, which torch_xla's bridge (matching outputs to inputs by identity) would
        # expect back from the graph and not get.
        return torch.nn.functional.linear(x, module.weight, module.bias)
    return LinearReadingWeight.apply(x, module.weight, module.bias)


def patch_linear_layers(module: torch.nn.Module) -> None:
    """Gives every ``nn.Linear`` in ``module`` that still uses the stock forward the
    weight-reading backward. Layers with a custom forward are left alone."""
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and \
                getattr(m.forward, "__func__", None) is torch.nn.Linear.forward:
            m.forward = MethodType(_forward, m)
