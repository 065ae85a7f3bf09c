"""The model's FLOPs in a traced step: its forward pass's matmuls as the step issues them
(see [Note: model FLOPs and hardware FLOPs] in ``aot/report.py``).

A torch-function mode sees the matmul-like functions the step calls on XLA tensors
(``F.linear``, ``matmul`` and ``@``, ``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``einsum``,
convolutions, ``scaled_dot_product_attention``) and adds their FLOPs while no backward pass
runs: what a backward computes, recomputation of checkpointed layers included, is not the
model's. A function called inside another one the mode counted is not seen again. It works
above the tensors (a dispatch mode would change the tensors torch_xla's functionalization
hands out, which swapping ``.data`` then refuses). Pallas attention kernels are counted by
``pallas`` through ``add``. The traced process multiplies by three (the forward, and the
backward's two matmuls per forward one).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _shape(t: Any) -> Sequence[int]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


def _matmul(a: Any, out: Any) -> float:
    """2 x output elements x the contracted length (``a``'s last dimension)."""
    return 2.0 * math.prod(_shape(out)) * (_shape(a) or (1,))[-1]


def _first(args: tuple, kwargs: dict, out: Any) -> float:   # linear(x, w), mm(a, b), ...
    return _matmul(args[0], out)


def _added(args: tuple, kwargs: dict, out: Any) -> float:   # addmm(input, a, b)
    return _matmul(args[1], out)


def _einsum(args: tuple, kwargs: dict, out: Any) -> float:
    """2 x the product of every index's size, for a contraction of two operands."""
    equation, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str) or len(operands) != 2 or "..." in equation:
        return 0.0
    sizes: Dict[str, int] = {}
    for labels, operand in zip(equation.split("->")[0].split(","), operands):
        for label, size in zip(labels.strip(), _shape(operand)):
            sizes[label] = size
    return 2.0 * math.prod(sizes.values())


def _convolution(args: tuple, kwargs: dict, out: Any) -> float:
    weight = _shape(args[1] if len(args) > 1 else kwargs.get("weight"))
    return 2.0 * math.prod(_shape(out)) * math.prod(weight[1:])


def _attention(args: tuple, kwargs: dict, out: Any) -> float:
    """Two matmuls over the scores; half when causal (see the Note)."""
    q, k = _shape(args[0]), _shape(args[1])
    causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
    return 4.0 * math.prod(q[:-1]) * k[-2] * q[-1] * (0.5 if causal else 1.0)


_FORMULAS: Dict[Callable[..., Any], Callable[[tuple, dict, Any], float]] = {
    F.linear: _first, torch.matmul: _first, torch.Tensor.matmul: _first,
    torch.Tensor.__matmul__: _first, torch.mm: _first, torch.Tensor.mm: _first, torch.bmm: _first,
    torch.Tensor.bmm: _first, torch.addmm: _added, torch.Tensor.addmm: _added,
    torch.baddbmm: _added, torch.Tensor.baddbmm: _added, torch.einsum: _einsum,
    F.conv1d: _convolution, F.conv2d: _convolution, F.conv3d: _convolution,
    F.scaled_dot_product_attention: _attention}


class ForwardFlops(TorchFunctionMode):
    """Passes forward matmul FLOPs to ``sink`` while ``backward_depth`` is 0."""

    def __init__(self, sink: Callable[[float], None]) -> None:
        super().__init__()
        self.sink = sink
        self.backward_depth = 0

    @contextlib.contextmanager
    def in_backward(self) -> Iterator[None]:
        """Within the block a backward pass runs: nothing is counted."""
        self.backward_depth += 1
        try:
            yield
        finally:
            self.backward_depth -= 1

    def add(self, flops: float) -> None:
        """FLOPs of work the formulas cannot see (a kernel), if in the forward pass."""
        if self.backward_depth == 0:
            self.sink(flops)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FORMULAS.get(func)
        if formula is not None and self.backward_depth == 0 and _on_xla(args):
            self.sink(formula(args, kwargs, out))
        return out


def _on_xla(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type == "xla" for a in args)
