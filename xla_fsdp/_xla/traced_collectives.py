"""The collectives a graph Dynamo traces holds: a unit's all-gathers whose backward is the
matching reduce-scatters, and the barrier that orders one unit's reductions before the next
unit's backward (see [Note: collectives traced into the compiled graph] in
``_unit.traced_unshard``). The eager path's collectives are ``_sharding.collectives``."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from .._sharding.collectives import optimization_barrier, reduction_input
from .private_api import functional_all_gather, functional_reduce_scatter


@torch.library.custom_op("xla_fsdp::barrier", mutates_args=())
def _barrier(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """The tensors, behind one optimization barrier: none of the results exists before all
    of the inputs do. An op of its own so that a graph Dynamo traces keeps it (the barrier is
    an in-place binding Dynamo cannot trace); torch_xla's compile bridge runs it while it
    builds the program, which puts the barrier in."""
    out = [t.clone() for t in tensors]
    optimization_barrier(out)
    return out


@_barrier.register_fake
def _(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    return [torch.empty_like(t) for t in tensors]


class _TracedUnitGather(torch.autograd.Function):
    """A unit's all-gathers over every rank, whose backward is the matching reduce-scatters,
    in the ops Dynamo traces into a compiled graph (torch's functional collectives, which
    torch_xla lowers to XLA's own: ``private_api.functional_all_gather``): see [Note:
    collectives traced into the compiled graph]. Each piece is cast to the compute dtype
    inside, so that its gradient comes back in the shard's dtype with the rounding of the
    eager reduction (``padded_gradient`` then ``scatter_gradients``): reduced in
    ``reduce_dtype``, prepared as the eager one is (``reduction_input``), and cast to
    the shard's dtype after.

    [Note: one unit's reductions before the next unit's backward] Traced reduce-scatters
    are independent ops, and libtpu rewrote a backward program's 101 of them into 2
    all-reductions issued at its end, so every unit's full gradients lived until then
    (benchmarks/results/compiled_tpu.md). The eager program keeps them apart with
    optimization barriers; here the unit's input ``x`` passes through this function, and
    the gradient that leaves the unit for the one before it passes a barrier with the unit's
    reduced gradients. The previous unit's backward, and so its reduce-scatters, come after
    this unit's: one unit's full gradients at a time, as eagerly."""

    @staticmethod
    def forward(ctx: Any, spec: tuple, x: Optional[torch.Tensor],
                *pieces: torch.Tensor) -> Any:
        world, compute_dtypes, _, _, _ = spec
        ctx.reduction, ctx.dtypes, ctx.tied = spec, [p.dtype for p in pieces], x is not None
        fulls = []
        for piece, compute_dtype in zip(pieces, compute_dtypes):
            send = piece if piece.dtype == compute_dtype else piece.to(compute_dtype)
            fulls.append(functional_all_gather(send.contiguous(), world))
        return (x.view_as(x), *fulls) if x is not None else tuple(fulls)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        world, _, reduce_dtypes, pre, post = ctx.reduction
        grad_x, grads = (grads[0], grads[1:]) if ctx.tied else (None, grads)
        reduced = []
        for grad, dtype, reduce_dtype in zip(grads, ctx.dtypes, reduce_dtypes):
            flat, scale = reduction_input(grad, reduce_dtype, (pre, post))
            out = functional_reduce_scatter(flat.contiguous(), world) * scale
            reduced.append(out if out.dtype == dtype else out.to(dtype))
        if grad_x is not None:
            *reduced, grad_x = torch.ops.xla_fsdp.barrier(reduced + [grad_x])
        return (None, grad_x, *reduced)


def traced_gather(pieces: Sequence[torch.Tensor], x: Optional[torch.Tensor], world: int,
                  compute_dtypes: Sequence[torch.dtype], reduce_dtypes: Sequence[torch.dtype],
                  divide: Tuple[float, float]) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
    """Each piece of every rank, concatenated along dim 0 in its compute dtype, as values a
    compiled graph holds, and ``x`` (a unit's input, or None) tied to their reductions (see
    [Note: one unit's reductions before the next unit's backward]); the gradients are reduce-
    scattered back to the pieces and averaged as ``scatter_gradients`` averages (``divide``:
    the pre- and post-division factors)."""
    spec = (world, tuple(compute_dtypes), tuple(reduce_dtypes), *divide)
    out = _TracedUnitGather.apply(spec, x, *pieces)
    return (out[0], list(out[1:])) if x is not None else (None, list(out))
