"""Lookups and output projections computed on a vocabulary table's row block, for every
rank's tokens at once: the data-parallel form of Megatron's vocabulary-parallel embedding.

[Note: vocabulary-parallel tables]
Replica FSDP gathers a unit's whole table before it runs: at a 128K vocabulary that is 1 GiB
per chip for Llama 3.2 1B's embedding (float32), the same again for its gradient, and the
logits' buffers beside them. FSDPv2's partitioner never holds it: it computes the lookup,
the output projection and the loss on vocabulary-sharded weights. With ``vocab_parallel``,
a table (``nn.Embedding`` weights, and ``nn.Linear`` weights shaped like one: the LM
head, tied or not) stays a row block, ``shard_rows = ceil(V / N)`` rows per rank,
and its modules compute on it:

* lookup: the ranks' token ids are gathered (integers, a few KiB); each rank looks up the
  ids that fall in its rows, zeros for the rest; a reduce-scatter over the tokens sums
  the N partial embeddings and leaves each rank its own tokens' rows;
* projection: the ranks' hidden states are gathered; each rank computes every token's
  logits for its rows; an all-to-all returns to each rank its own tokens' logits for
  every rank's rows, so the loss (the user's or the model's) sees the logits it would see
  unsharded, on the rank's own tokens.

Autograd runs the collectives' transposes (reduce-scatter <-> all-gather, the all-to-all
is its own), so each rank's table gradient is the sum over every rank's tokens for its
rows, already reduced: it is divided by the unit's gradient divide factors instead of
going through a reduce-scatter. What moves per step is activations (the tokens' hidden
states twice, their logits twice), not the table three times.

The collectives' shapes are the batch's, so every rank's batch must have the same shape,
as FSDPv2's global batch has; ranks whose shapes differ compile different programs, which
the virtual launcher refuses and a pod cannot run.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from .collectives import Collectives, optimization_barrier


def _exchange(collectives: Collectives, x: torch.Tensor, gather: bool) -> torch.Tensor:
    """Every rank's rows along dim 0 (``gather``), else every rank's rows summed and this
    rank's dim-0 block kept."""
    if gather:
        return collectives.all_gather([x], coalesce=False)[0]
    return collectives.reduce_scatter([x], 1.0)[0]


class _Exchange(torch.autograd.Function):
    """``_exchange``, whose gradient is the other exchange: a gather's is reduce-scattered
    back, a sum's is gathered."""

    @staticmethod
    def forward(ctx: Any, collectives: Collectives, x: torch.Tensor,
                gather: bool) -> torch.Tensor:
        ctx.vocab_collectives, ctx.gather = collectives, gather
        return _exchange(collectives, x, gather)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, torch.Tensor, None]:
        return None, _exchange(ctx.vocab_collectives, grad.contiguous(), not ctx.gather), None


class _Project(torch.autograd.Function):
    """Every rank's tokens' logits for this rank's rows, exchanged so that each rank gets its
    own tokens' logits over every rank's rows: an all-to-all from row block ``j`` (rank
    ``j``'s tokens) to rank ``j``, the blocks received side by side in rank order, so no
    transpose of the logits follows. Backward computes the table's gradient beside the
    hidden states' behind one barrier: left free, libtpu's scheduler defers it, a weight
    gradient nothing reads before the update, to the end of backward, and the logits'
    gradient (a GiB at a 128K vocabulary) stays live all that time."""

    @staticmethod
    def forward(ctx: Any, collectives: Collectives, rows: torch.Tensor,
                every: torch.Tensor) -> torch.Tensor:
        ctx.vocab_collectives = collectives
        ctx.save_for_backward(rows, every)
        return collectives.all_to_all(F.linear(every, rows), split=0, concat=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, torch.Tensor, torch.Tensor]:
        rows, every = ctx.saved_tensors
        mine = ctx.vocab_collectives.all_to_all(grad.contiguous(), split=1, concat=0)
        grad_every = mine @ rows
        if not ctx.needs_input_grad[1]:  # a frozen table
            return None, None, grad_every
        grad_rows = mine.t() @ every
        optimization_barrier([grad_every, grad_rows])
        return None, grad_rows, grad_every


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.gradient_scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad * ctx.gradient_scale, None


def table_rows(shard: torch.Tensor, dtype: torch.dtype, divisor: float) -> torch.Tensor:
    """The row block as the modules compute with it, in ``dtype``; its gradient (the sum
    over every rank's tokens) divided by ``divisor``."""
    rows = _ScaleGradient.apply(shard, 1.0 / divisor) if divisor != 1 else shard
    return rows if rows.dtype == dtype else rows.to(dtype)


def lookup(collectives: Collectives, rows: torch.Tensor, first: torch.Tensor,
           ids: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
    """``F.embedding(ids, table, padding_idx)`` where this rank holds ``rows``, the block of
    the table from row ``first`` (a device tensor: a constant would make each rank's
    program its own)."""
    block = rows.shape[0]
    every = _exchange(collectives, ids.reshape(-1), gather=True)
    local = every - first
    inside = (local >= 0) & (local < block)
    found = F.embedding(torch.where(inside, local, torch.zeros_like(local)), rows)
    found = found * inside.unsqueeze(1).to(rows.dtype)
    if padding_idx is not None:  # the padding row's value, but no gradient into it
        found = torch.where((every == padding_idx).unsqueeze(1), found.detach(), found)
    return _Exchange.apply(collectives, found, False).reshape(*ids.shape, rows.shape[1])


def project(collectives: Collectives, rows: torch.Tensor, hidden: torch.Tensor,
            vocab: int) -> torch.Tensor:
    """``F.linear(hidden, table)`` where this rank holds ``rows``, its block of the table's
    ``vocab`` rows (padded to a multiple of the world size)."""
    tokens = hidden.reshape(-1, hidden.shape[-1])
    every = _Exchange.apply(collectives, tokens, True)
    logits = _Project.apply(collectives, rows, every)
    if logits.shape[1] != vocab:
        logits = logits[:, :vocab]
    return logits.reshape(*hidden.shape[:-1], vocab)
