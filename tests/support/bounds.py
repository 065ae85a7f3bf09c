"""The parity bounds: how far a run may be from its reference, step by step, whatever the
suite compares (sharded against unsharded, compiled against eager, resumed against trained).

[Note: parity bounds]
A float32 run is held to 1e-5: every loss relative, and with SGD every parameter.
A run with ``compute_dtype=torch.bfloat16`` rounds every result to 8 bits, relative
2^-8 = 3.9e-3, and the sharded run sums its ranks' gradients (in bf16 unless
``fp32_reduce_scatter``) where an unsharded one sums once. It is held to 2^-8 on every loss
and 5e-3 on every parameter with SGD (measured, SGD with momentum at lr 0.1 over 6 steps,
N = 2, 4 and 8: losses within 1.5e-3, parameters within 1.1e-3, BatchNorm's running
statistics within 4e-4).
An adaptive optimizer (one that divides by a running magnitude, as Adam's family, Adagrad
and RMSprop do, or steps by the gradient's sign, as Rprop does) can move a weight whose
gradient is zero up to rounding by a whole step, either way, in either run. So each
parameter is held to ``moved``, twice the sum of the steps, and most of its elements to
``ADAPTIVE_MOST``: in float32 all but 1% within 1e-5. In bf16 a gradient is at rounding
level 2^16 times as often, so all but 2^-5 = 3.1% within 1e-3, or all but two elements
(measured over the matrix's adaptive optimizers at N = 2 and 4: at most 1.2% of a weight of
2,240 elements, two of a LayerNorm's 32, one of a bias's 70). A wrong shard, an eighth or
more of a parameter at N <= 8, fails either.
Against which reference: the unsharded model computing in the run's dtype
(``models.forward_in``: bf16 copies of the float32 parameters); the matrix's also sums its
gradients as the ranks do (see [Note: a low-precision reference reduces as the ranks do]). A
float32 reference puts 1.2% to 1.9% of an adaptive optimizer's weights beyond 1e-3 in bf16,
from the rounding of the forward alone, against 0.24% to 0.38% for the bf16 reference (the
matrix's optimizers, N = 2). With SGD either reference is within the bounds, so attention
(which a bf16 unit computes its own way, see [Note: attention under a low-precision
compute_dtype]) and the compiled settings keep a float32 one: within 7e-5 on losses and
4.1e-4 on parameters.
"""
from typing import Dict, List, Optional, Sequence

import torch

LOSS = {"float32": 1e-5, "low": 2 ** -8}
PARAM = {"float32": 1e-5, "low": 5e-3}
ADAPTIVE_MOST = {"float32": 1e-5, "low": 1e-3}
FEW = {"float32": 0.01, "low": 2 ** -5}
FEW_ELEMENTS = {"float32": 0, "low": 2}


def precision(compute_dtype: Optional[torch.dtype]) -> str:
    """The bounds' key for a run computing in ``compute_dtype`` (None: float32)."""
    return "float32" if compute_dtype in (None, torch.float32) else "low"


def loss_problems(got: Sequence[float], want: Sequence[float], key: str,
                  what: str = "loss") -> List[str]:
    """Each step whose ``what`` is beyond the bound, once both runs are known to have run
    the same number of steps."""
    if len(got) != len(want):
        return [f"{len(got)} steps' {what} against the reference's {len(want)}"]
    return [f"step {step} {what} {a:.7g} vs {b:.7g}" for step, (a, b) in
            enumerate(zip(got, want, strict=True)) if not abs(a - b) <= LOSS[key] * abs(b)]


def parameter_problems(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], key: str,
                       moved: Optional[float] = None) -> List[str]:
    """Each parameter beyond the bound; ``moved``: an adaptive optimizer's allowance, None
    for SGD (see [Note: parity bounds])."""
    if set(got) != set(want):
        return [f"parameter names differ: {sorted(set(got) ^ set(want))}"]
    problems = []
    for name, value in want.items():
        diff = (got[name].float() - value.float()).abs()
        if moved is not None:
            count = int((diff > ADAPTIVE_MOST[key]).sum())
            beyond = count / max(diff.numel(), 1)
            if not (diff.max() <= moved and (beyond <= FEW[key] or count <= FEW_ELEMENTS[key])):
                problems.append(f"{name} max diff {diff.max():.3g}, {beyond:.2%} beyond "
                                f"{ADAPTIVE_MOST[key]:g}")
        elif not diff.max() <= PARAM[key]:
            problems.append(f"{name} max diff {diff.max():.3g}")
    return problems
