"""Attention inside a unit: no probabilities kept for backward, and inside a low-precision
unit its matmuls in the compute dtype.

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

Inside a unit whose ``compute_dtype`` is low precision, ``torch.nn.functional``'s
``scaled_dot_product_attention`` and ``softmax`` compute instead:
- attention of low-precision inputs as two matmuls in the inputs' dtype around a softmax
  computed in float32 (scale and mask applied in float32), whose output is rounded once to
  the inputs' dtype: what the second matmul multiplies and what backward keeps;
- ``softmax(x, dtype=torch.float32)`` of a low-precision attention matrix ``x`` (4-D:
  batch, heads, queries, keys; along the keys) in float32 as asked, keeping for backward its
  output rounded to ``x``'s dtype. Other float32 softmaxes (a mixture of experts' router's,
  2-D) are left as written: they are small, and their gradients keep float32's precision.
Both softmax backwards are computed in float32 from low-precision probabilities. Hugging
Face's eager path multiplies by the probabilities itself, so ``_SoftmaxKeptLow`` keeps them in
the low precision. Nothing float32 of shape (batch, heads, queries, keys) outlives the forward,
and XLA fuses the casts, scale, mask and softmax into the matmuls' neighbours.

[Note: attention inside a unit keeps no probabilities]
On XLA torch's sdpa runs its math path, and autograd keeps each layer's probabilities from
forward to backward: (batch, heads, queries, keys), 512 MiB per layer in float32 for the
Llama 1B at 2,048 tokens, more than half the 1B step's peak on a v5e-8. Inside any unit (any
``compute_dtype``), sdpa is one autograd function instead (``_Attention``), computed as flash
attention's backward computes it:
- forward takes the probabilities as ``exp(scores - log_sum)``, with each row's log-sum-exp
  of the scores, and keeps query, key, value (which its matmuls' backwards keep anyway), the
  output and the log-sums: a row of floats per query, not a matrix;
- backward computes the scores again and the probabilities from them and the kept log-sums,
  one elementwise pass that XLA fuses into the query-key matmul (no softmax again), and
  softmax's backward ``p * (g - sum_j p_j g_j)`` takes its row sum as ``grad . output``, so
  no reduction runs over the attention matrix.
Float32 scores are scaled as torch's math path scales them (query and key each by the root of
``scale``); outputs and gradients then equal torch's to float32's rounding (within torch's
``assert_close`` defaults on XLA:CPU, every mask kind). Off XLA, torch's fused kernels keep no
probabilities, and float32 tensors pass through.
The recompute sits behind an optimization barrier over everything it reads: without it XLA's
common-subexpression pass merges it with the forward's identical computation, and the
probabilities are kept after all (libtpu kept all 32 layers' bf16 probabilities of the Llama
8B shape that way). Under ``torch.compile`` forward and backward are separate programs, and
Dynamo cannot trace the barrier, so there is none.
libtpu's figures (``docs/tpu_step.md``): the 1B float32 step peaks at about half the memory
and accesses no more HBM than with the probabilities kept; the 8B shape's bf16 step needs 19
instead of 27 GiB. With dropout, or a mask that requires grad, attention keeps its
probabilities (a dropout mask cannot be drawn again); float32 then is torch's sdpa.
Masks, ``is_causal``, ``scale``, dropout and ``enable_gqa`` mean what they mean to torch; a
row that masks every key gets zero probabilities, as torch's math path gives it.

The two functions are wrapped once per process (``install``, from ``process_effects``) and
act only on a thread that holds the scope; anywhere else and for tensor subclasses they are
torch's own, and TorchScript compiles them as torch's operators. Under ``torch.compile`` they
act as they do eagerly: Dynamo traces the scope's flag, a thread-local boolean, and guards the
compiled code on its value. So a block compiled inside a low-precision unit computes
attention as the eager block does, the same code outside any unit compiles with torch's, and
every rank (thread) passes the same guards.
Not a torch-function mode: a mode would run Python for every operation of the forward (about
4 us each here), a wrapper only for these two. Code that bound torch's functions to its own
names before the first unit was built keeps torch's; Hugging Face looks them up at each
call, and so does ``nn.MultiheadAttention``.

Where the scope holds: from a unit's pre-forward hook to its post-forward hook
(the outermost unit's, so the root's covers the model; hooks that Dynamo traces, under a
compiled root, take and end it too), whether the forward runs first
or again as a recompute in backward (``torch.utils.checkpoint`` around or inside the unit,
e.g. Hugging Face 4's gradient checkpointing, runs the unit's hooks again). A recompute that
bypasses the unit's hooks (``checkpoint_module`` or torch's checkpoint inside the unit, as
Hugging Face 5's decoder layers take it) runs in the unit's backward, and the scope holds
from a unit's pre-backward hook to the end of the backward. So the recomputed step is the
same program. (Code outside every unit but recomputed after a unit's backward began, a
checkpointed module before the root, would recompute inside the scope: torch's
non-reentrant checkpoint then refuses it loudly. Wrap the whole model.) A forward that
raises ends it (``abandon``, from the unit's ``forward_raised``). What the wrappers do
depends on the inputs' dtype, not the unit's: a float32 unit inside a bf16 one computes
float32 attention, a bf16 unit inside a float32 root bf16 attention.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from .._sharding.collectives import optimization_barrier
from .._xla.private_api import script_as

LOW_PRECISION = (torch.bfloat16, torch.float16)
_SCOPE = threading.local()   # one device per thread under the virtual launcher
_TORCH: dict = {}            # torch's own functions, once installed


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


def _scaled(query: torch.Tensor, key: torch.Tensor, scale: float
            ) -> Tuple[torch.Tensor, torch.Tensor, Tuple[float, float, float]]:
    """(query and key scaled before their matmul; the query's, the key's and the float32
    scores' factors, ``after`` last). Float32 scores are scaled as torch's math path scales
    them, query and key each by the root of ``scale`` (see [Note: attention inside a unit
    keeps no probabilities])."""
    factors = ((math.sqrt(scale), math.sqrt(scale), 1.0) if query.dtype == torch.float32
               else (1.0, 1.0, scale))
    return _times(query, factors[0]), _times(key, factors[1]), factors


def _scores(query: torch.Tensor, key: torch.Tensor, after: float, causal: bool,
            mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the scores of the scaled query and key in float32, times ``after``, plus the mask
    (boolean: keep; else added), the rows that mask every key; None without a mask)."""
    scores = _times((query @ key.transpose(-2, -1)).float(), after)
    if causal:   # every row keeps its first key: no row is masked whole
        drop = torch.ones(scores.shape[-2:], dtype=torch.bool, device=query.device).triu(1)
        return scores.masked_fill(drop, -math.inf), None
    if mask is None:
        return scores, None
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -math.inf)
    else:
        scores = scores + mask.float()
    return scores, (scores == -math.inf).all(-1, keepdim=True)


def _times(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x if factor == 1.0 else x * factor


def _probabilities(query: torch.Tensor, key: torch.Tensor, after: float, causal: bool,
                   mask: Optional[torch.Tensor], log_sums: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the attention probabilities of the scaled query and key, in the query's dtype, a row
    masking every key all zeros; each row's log-sum-exp of the scores, in float32), as
    ``exp(scores - log_sum)``, from the log-sums given or taken here."""
    scores, masked_rows = _scores(query, key, after, causal, mask)
    if log_sums is None:
        log_sums = torch.logsumexp(scores, -1, keepdim=True)
    probs = torch.exp(scores - log_sums)
    if masked_rows is not None:   # exp(-inf - -inf) is NaN
        probs = probs.masked_fill(masked_rows, 0.0)
    return probs.to(query.dtype), log_sums


class _Attention(torch.autograd.Function):
    """``probabilities @ value`` that keeps for backward query, key, value, the output and
    each row's log-sum-exp, not the probabilities, and computes them again there (see [Note:
    attention inside a unit keeps no probabilities])."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scale: float, causal: bool, mask: Optional[torch.Tensor]) -> torch.Tensor:
        # kept scaled: backward's recompute and its gradients read them as they are
        query, key, factors = _scaled(query, key, scale)
        ctx.attention_factors = factors + (causal,)
        probs, log_sums = _probabilities(query, key, factors[2], causal, mask)
        out = probs @ value
        ctx.save_for_backward(query, key, value, mask, out, log_sums)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        query, key, value, mask, out, log_sums = ctx.saved_tensors
        q_scale, k_scale, after, causal = ctx.attention_factors
        if query.device.type == "xla" and not torch.compiler.is_compiling():
            # see [Note: attention inside a unit keeps no probabilities]
            optimization_barrier([query, key, value, mask, out, log_sums, grad])
        probs, _ = _probabilities(query, key, after, causal, mask, log_sums)
        grad_value = probs.transpose(-2, -1) @ grad
        # softmax's backward, p * (g - sum_j p_j g_j), with the sum taken as grad . out
        g = (grad @ value.transpose(-2, -1)).float()
        row = (grad.float() * out.float()).sum(-1, keepdim=True)
        grad_scores = _times(probs.float() * (g - row), after).to(query.dtype)
        grad_query = _times(grad_scores @ key, q_scale)
        grad_key = _times(grad_scores.transpose(-2, -1) @ query, k_scale)
        return grad_query, grad_key, grad_value, None, None, None


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: Optional[float] = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` with its matmuls in the inputs' dtype (see [Note:
    attention under a low-precision compute_dtype])."""
    if attn_mask is not None and is_causal:
        raise ValueError("scaled_dot_product_attention: pass attn_mask or is_causal, not both")
    kept = dropout_p > 0.0 or (attn_mask is not None and attn_mask.requires_grad)
    if query.dtype == torch.float32 and kept:
        # torch takes ``scale`` and ``enable_gqa`` by keyword only
        return _TORCH["sdpa"](query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                              enable_gqa=enable_gqa)
    if enable_gqa and key.size(-3) != query.size(-3):
        repeat = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    if scale is None:
        scale = 1.0 / math.sqrt(query.size(-1))
    if query.dtype == torch.float16:  # unscaled q.k can exceed float16's range (65504)
        query, scale = query * scale, 1.0
    if not kept:
        return _Attention.apply(query, key, value, scale, is_causal, attn_mask)
    # dropout's mask cannot be drawn again in backward: the probabilities are kept
    query, key, factors = _scaled(query, key, scale)
    scores, masked_rows = _scores(query, key, factors[2], is_causal, attn_mask)
    probs = _SoftmaxKeptLow.apply(scores, -1, query.dtype, query.dtype, masked_rows)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, training=True)
    return probs @ value


def _holds(x: Any) -> bool:
    """Whether ``x`` is a plain low-precision tensor on a thread inside the scope."""
    return active() and type(x) is torch.Tensor and x.dtype in LOW_PRECISION


def _recomputes(query: Any, key: Any, value: Any) -> bool:
    """Whether float32 attention on this thread is computed again in backward: inside the
    scope, plain XLA tensors (elsewhere torch's fused kernels keep no probabilities), a
    gradient to take."""
    return (active() and torch.is_grad_enabled()
            and all(type(x) is torch.Tensor and x.dtype == torch.float32
                    and x.device.type == "xla" for x in (query, key, value))
            and any(x.requires_grad for x in (query, key, value)))


def install() -> None:
    """Wraps ``F.scaled_dot_product_attention`` and ``F.softmax`` once per process."""
    if _TORCH:
        return
    _TORCH.update(sdpa=F.scaled_dot_product_attention, softmax=F.softmax)

    @functools.wraps(_TORCH["sdpa"])
    def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor,
                                     value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _holds(query) or _recomputes(query, key, value):
            return attention(query, key, value, *args, **kwargs)
        return _TORCH["sdpa"](query, key, value, *args, **kwargs)

    @functools.wraps(_TORCH["softmax"])
    def softmax(input: torch.Tensor, dim: Optional[int] = None, _stacklevel: int = 3,
                dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if (dtype is torch.float32 and _holds(input) and input.dim() == 4 and dim in (-1, 3)
                and input.requires_grad and torch.is_grad_enabled()):
            return _SoftmaxKeptLow.apply(input, dim, torch.float32, input.dtype, None)
        return _TORCH["softmax"](input, dim, _stacklevel, dtype)

    # scripted code calls torch's operators, as it did before (TorchScript cannot compile
    # the wrappers)
    script_as(scaled_dot_product_attention, "aten::scaled_dot_product_attention")
    script_as(softmax, "aten::softmax")
    F.scaled_dot_product_attention = scaled_dot_product_attention
    F.softmax = softmax


def active() -> bool:
    """Whether this thread computes inside a unit: its forward, or a backward of its model
    (see [Note: attention inside a unit keeps no probabilities])."""
    # a boolean beside the owner: Dynamo guards on its value, where a guard on the owner
    # (another object on every rank) would recompile per rank
    return getattr(_SCOPE, "held", False)


def enter(owner: Any) -> None:
    """Starts the scope for ``owner`` unless it holds already (an outer unit's);
    ``leave(owner)`` ends what ``owner`` started."""
    if not active():
        _SCOPE.owner, _SCOPE.held = owner, True


def leave(owner: Any) -> None:
    if active() and _SCOPE.owner == owner:
        abandon()


def abandon() -> None:
    """Ends the scope after a forward that raised between ``enter`` and ``leave``."""
    _SCOPE.owner, _SCOPE.held = None, False
