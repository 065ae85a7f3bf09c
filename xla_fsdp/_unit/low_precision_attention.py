"""Attention inside a low-precision unit: its matmuls in the compute dtype, and nothing the size
of the attention matrix kept in float32 for backward.

[Note: attention under a low-precision compute_dtype]
Two attention paths undo ``compute_dtype=torch.bfloat16`` (or float16) where it matters most:
- torch's ``scaled_dot_product_attention`` runs its math path on XLA, which casts a bf16
  query, key and value to float32 unless a process-wide flag
  (``allow_fp16_bf16_reduction_math_sdp``) says otherwise. Both attention matmuls then run in
  float32, and backward keeps float32 copies of q, k, v and the float32 probabilities.
- Hugging Face's eager attention takes ``softmax(scores, dtype=torch.float32)`` and casts the
  result back to bf16: autograd keeps the float32 probabilities for the softmax's backward
  besides the bf16 ones for the next matmul, 6 bytes per score against float32 compute's 4.
So the bf16 step needed more HBM than the float32 one (issue 52: the Llama 8B shape on v6e-8,
35.70 against 28.61 GiB).

Inside a unit whose ``compute_dtype`` is low precision, a torch-function mode
(``low_precision_attention``) computes instead:
- ``scaled_dot_product_attention`` of low-precision inputs as two matmuls in the inputs'
  dtype around a softmax computed in float32 (scale and mask applied in float32), whose
  output is rounded once to the inputs' dtype: what the second matmul multiplies and what
  backward keeps;
- ``softmax(x, dtype=torch.float32)`` of a low-precision attention matrix ``x`` (4-D:
  batch, heads, queries, keys; along the keys) in float32 as asked, keeping for backward its
  output rounded to ``x``'s dtype. Other float32 softmaxes (a mixture of experts' router's,
  2-D) are left as written: they are small, and their gradients keep float32's precision.
Both softmax backwards are computed in float32 from the kept probabilities
(``_SoftmaxKeptLow``). Nothing float32 of shape (batch, heads, queries, keys) outlives the
forward, and XLA fuses the casts, scale, mask and softmax into the matmuls' neighbours.
Masks, ``is_causal``, ``scale``, dropout and ``enable_gqa`` mean what they mean to torch; a
row that masks every key gets zero probabilities, as torch's math path gives it.

Where the mode holds: from a low-precision unit's pre-forward hook to its post-forward hook
(the outermost such unit's, so the root's covers the model), whether the forward runs first
or again as a recompute in backward (``torch.utils.checkpoint`` around or inside the unit,
e.g. Hugging Face's gradient checkpointing, runs the unit's hooks again). A recompute that
bypasses the unit's hooks, ``checkpoint_module``'s inside the unit, pushes it again when the
forward it recomputes ran under it. So the recomputed step is the same program. A forward
that raises pops it in the unit's ``forward`` (inside backward, the autograd engine restores
the thread's modes after each node). A forward traced by ``torch.compile`` is left as
written, and a float32 unit inside a bf16 one sees float32 inputs, which the mode passes
through.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

LOW_PRECISION = (torch.bfloat16, torch.float16)
_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax)
_ACTIVE = threading.local()   # one device per thread under the virtual launcher


class _SoftmaxKeptLow(torch.autograd.Function):
    """``softmax(x.float(), dim)`` returned in ``out_dtype``, kept for backward in ``kept``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, out_dtype: torch.dtype,
                kept: torch.dtype, masked_rows: Optional[torch.Tensor]) -> torch.Tensor:
        y = torch.softmax(x.float(), dim)
        if masked_rows is not None:
            y = y.masked_fill(masked_rows, 0.0)
        ctx.dim, ctx.in_dtype = dim, x.dtype
        ctx.save_for_backward(y.to(kept))
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (kept,) = ctx.saved_tensors
        y, g = kept.float(), grad.float()
        dx = y * (g - (g * y).sum(ctx.dim, keepdim=True))
        return dx.to(ctx.in_dtype), None, None, None, None


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: Optional[float] = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` with its matmuls in the inputs' dtype (see [Note:
    attention under a low-precision compute_dtype])."""
    if attn_mask is not None and is_causal:
        raise ValueError("scaled_dot_product_attention: pass attn_mask or is_causal, not both")
    if enable_gqa and key.size(-3) != query.size(-3):
        repeat = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    if scale is None:
        scale = 1.0 / math.sqrt(query.size(-1))
    scores = (query @ key.transpose(-2, -1)).float() * scale
    masked_rows = None
    if is_causal:
        n, s = query.size(-2), key.size(-2)
        attn_mask = torch.ones(n, s, dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask.float()
        masked_rows = (scores == -math.inf).all(-1, keepdim=True)
    probs = _SoftmaxKeptLow.apply(scores, -1, query.dtype, query.dtype, masked_rows)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, training=True)
    return probs @ value


def _softmax_request(func: Any, args: tuple, kwargs: dict) -> Optional[tuple]:
    """(input, dim) of a ``softmax(x, dim, dtype=torch.float32)`` of a low-precision attention
    matrix ``x`` that autograd would keep in float32, or None."""
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    # F.softmax(input, dim, _stacklevel, dtype); torch.softmax and Tensor.softmax(x, dim, dtype)
    at = 3 if func is F.softmax else 2
    dtype = args[at] if len(args) > at else kwargs.get("dtype")
    if (dtype is torch.float32 and isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION
            and x.dim() == 4 and dim in (-1, 3) and x.requires_grad and torch.is_grad_enabled()):
        return x, dim
    return None


class _LowPrecisionAttention(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if not torch.compiler.is_compiling():
            if func is F.scaled_dot_product_attention:
                q = args[0] if args else kwargs.get("query")
                if isinstance(q, torch.Tensor) and q.dtype in LOW_PRECISION:
                    return attention(*args, **kwargs)
            elif func in _SOFTMAX:
                request = _softmax_request(func, args, kwargs)
                if request is not None:
                    x, dim = request
                    return _SoftmaxKeptLow.apply(x, dim, torch.float32, x.dtype, None)
        return func(*args, **kwargs)


def active() -> bool:
    """Whether this thread computes inside a low-precision unit's forward (and the mode is
    still on the thread's stack: the autograd engine drops what a node that raised pushed)."""
    mode = getattr(_ACTIVE, "mode", None)
    if mode is None:
        return False
    if any(m is mode for m in _get_current_function_mode_stack()):
        return True
    _ACTIVE.owner = _ACTIVE.mode = None
    return False


def enter(owner: Any) -> None:
    """Pushes the mode for ``owner`` unless it holds already (an outer unit pushed it) or
    Dynamo is tracing; ``leave(owner)`` pops what ``owner`` pushed."""
    if active() or torch.compiler.is_compiling():
        return
    mode = _LowPrecisionAttention()
    mode.__enter__()
    _ACTIVE.owner, _ACTIVE.mode = owner, mode


def leave(owner: Any) -> None:
    if active() and _ACTIVE.owner == owner:
        mode, _ACTIVE.owner, _ACTIVE.mode = _ACTIVE.mode, None, None
        mode.__exit__(None, None, None)


def abandon() -> None:
    """Pops the mode after a forward that raised between ``enter`` and ``leave``."""
    if active():
        leave(_ACTIVE.owner)


@contextlib.contextmanager
def low_precision_attention(enabled: bool = True) -> Iterator[None]:
    """The mode of [Note: attention under a low-precision compute_dtype] for a block of code,
    unless ``enabled`` is false, an outer unit holds it, or Dynamo is tracing."""
    owner = object()
    if enabled:
        enter(owner)
    try:
        yield
    finally:
        leave(owner)
