"""Pallas kernels in a traced step: lowered for the TPU on this CPU machine, and costed.

[Note: Pallas kernels in a plan] torch_xla's attention kernels (``flash_attention`` in
``torch_xla.experimental.custom_kernel``, ``splash_attention`` in its own module) are
Pallas kernels: jax lowers each to Mosaic, and torch_xla puts the result into its graph as
a ``tpu_custom_call`` that only a TPU runs. jax lowers a kernel for the platform of its
default backend, and on this machine that is the CPU, where Pallas offers only its
interpreter. The traced process therefore registers, for the CPU platform, a lowering of
``pallas_call`` that is jax's own Mosaic lowering for the TPU (``enable``); the custom call
it makes does not depend on the machine that made it, and libtpu compiles it as it would
on a TPU VM, with two adjustments (see [Note: Pallas kernels through StableHLO]).
Nothing executes, so the kernel never has to run here.

The step-time model needs each kernel's FLOPs, and a custom call shows none: jax attaches
an estimate to flash attention's forward kernel only, counted as if not causal. So while
torch_xla's ``FlashAttention`` or ``SplashAttention`` runs its forward or backward, the
lowering attaches an analytic estimate to each kernel it makes: 2 x M x N x K for each
matmul the kernel runs (a forward 2; flash's dq kernel 3 and dkv kernel 4; splash's dq 3
and its fused dkv 5, the dq partials included), half of it when the attention is causal,
and one exponential per score. The model's FLOPs count each attention forward once, as
MaxText does: 4 x batch x heads x query length x key length x head dim, half if causal.

jax is torch_xla's own requirement for these kernels (``pip install 'torch_xla[pallas]'``,
or this package's ``pallas`` extra); without it a plan of a step that calls them fails as
running it would.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Optional

from ..instruction_cost import attention_kernel_cost

_causal: Optional[bool] = None       # of the attention whose kernels are being lowered


def enable(devices: int, count_forward: Callable[[float], None]) -> bool:
    """In the traced process: Pallas kernels lower for the TPU (see [Note: Pallas kernels in
    a plan]), jax sees ``devices`` CPU devices (splash's mesh looks torch_xla's devices up
    among jax's), and each attention forward adds its FLOPs to ``count_forward``. False
    when jax is not installed: nothing to enable."""
    try:
        import jax
        import jax.experimental.pallas as pl   # before the Mosaic registration (jax 0.7.1)
        from jax._src.interpreters import mlir
        from jax._src.pallas import pallas_call
        from jax._src.pallas.mosaic import pallas_call_registration as mosaic
    except ImportError:
        return False
    with contextlib.suppress(Exception):   # only possible before jax starts its backends
        jax.config.update("jax_num_cpu_devices", devices)
    interpreted = pallas_call._pallas_call_lowering

    def lower_for_tpu(ctx: Any, *operands: Any, interpret: Any, backend: Any,
                      **params: Any) -> Any:
        if interpret:
            return interpreted(ctx, *operands, interpret=interpret, backend=backend, **params)
        cost = _kernel_cost(params["jaxpr"].debug_info.func_name, ctx.avals_in,
                            params["out_avals"])
        if cost is not None:
            params["cost_estimate"] = pl.CostEstimate(**cost)
        return mosaic.pallas_call_tpu_lowering_rule(ctx, *operands, interpret=interpret,
                                                    **params)

    mlir.register_lowering(pallas_call.pallas_call_p, lower_for_tpu, platform="cpu")
    _mark_causality(count_forward)
    return True


def _kernel_cost(name: str, inputs: Any, outputs: Any) -> Optional[dict]:
    """The analytic estimate of an attention kernel (None: not one, or causality unknown)."""
    if _causal is None:
        return None
    cost = attention_kernel_cost(name, [(str(a.dtype), a.shape) for a in inputs],
                                 [o.shape for o in outputs], _causal)
    if cost is not None:
        cost["bytes_accessed"] = sum(math.prod(a.shape) * a.dtype.itemsize
                                     for a in (*inputs, *outputs))
    return cost


@contextlib.contextmanager
def _attention(causal: Any) -> Iterator[None]:
    global _causal
    outer, _causal = _causal, bool(causal)
    try:
        yield
    finally:
        _causal = outer


def _mark_causality(count_forward: Callable[[float], None]) -> None:
    """torch_xla's attention Functions run their kernels' lowering knowing their
    causality, and their forwards count the model's attention FLOPs."""
    from torch_xla.experimental.custom_kernel import FlashAttention
    from torch_xla.experimental.splash_attention import SplashAttention

    for function, causal_at in ((FlashAttention, 3), (SplashAttention, 5)):
        forward, backward = function.forward, function.backward

        def counted_forward(ctx: Any, *args: Any, _forward: Any = forward,
                            _at: int = causal_at) -> Any:
            q, k, causal = args[0], args[1], args[_at]
            batch_heads_queries = math.prod(q.shape[:-1])
            count_forward(4 * batch_heads_queries * k.shape[-2] * q.shape[-1]
                          * (0.5 if causal else 1.0))
            with _attention(causal):
                return _forward(ctx, *args)

        def marked_backward(ctx: Any, *grads: Any, _backward: Any = backward) -> Any:
            with _attention(ctx.causal):
                return _backward(ctx, *grads)
        function.forward = staticmethod(counted_forward)
        function.backward = staticmethod(marked_backward)
