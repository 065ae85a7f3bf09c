"""What would fit, when a step does not: the switches a user has, tried on the step itself.

[Note: what would fit] libtpu refuses a program larger than the chip's HBM with the memory
it needs and nothing else, and a number alone does not say what to change. So the planner
tries what a user of ``xla_fsdp`` can change without touching the model, in this order, each
traced and compiled like the step itself (``traced/switches`` applies them to the unchanged
script): activation checkpointing per unit, bf16 compute, ``offload_optimizer``, their
combinations, a half and a quarter of the per-chip batch with as many accumulation steps,
and then the same step on the next larger slices. A candidate that traces the same
program as the step (a switch already on) is skipped uncompiled; one with
``offload_optimizer`` must fit the TPU VM's host memory as well. The first ``wanted``
configurations that fit are reported with their peak and estimated step time (an
accumulated step: that many micro-steps, each with its optimizer step, so a little more
than it will take); the search stops after ``budget`` compiles. A script that builds no
``xla_fsdp`` unit (torch_xla's FSDP, FSDPv2) can only be given more chips.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from ..launch.runner import LaunchError
from .report import Alternative, TpuReport
from .topology import Topology
from .traced.process import TracedStep
from .traced.switches import NotApplicable, Switches

CANDIDATES = (
    Switches(activation_checkpointing=True),
    Switches(bf16_compute=True),
    Switches(activation_checkpointing=True, bf16_compute=True),
    Switches(offload_optimizer=True),
    Switches(activation_checkpointing=True, offload_optimizer=True),
    Switches(activation_checkpointing=True, bf16_compute=True, offload_optimizer=True),
    Switches(batch_divisor=2),
    Switches(activation_checkpointing=True, batch_divisor=2),
    Switches(batch_divisor=4),
    Switches(activation_checkpointing=True, batch_divisor=4),
)
LARGER_SLICES = 2


def search(fn: Callable[..., Any], args: Sequence[Any], slice_: Topology, traced: TracedStep,
           trace: Callable[..., TracedStep], report: Callable[[TracedStep, Topology], TpuReport],
           wanted: int = 2, budget: int = 8, max_graphs: int = 12) -> List[Alternative]:
    """Tries the candidates (see [Note: what would fit]); returns each one compiled, in
    order, those that fit and those that did not."""
    found: List[Alternative] = []
    compiles = 0
    seen = {_fingerprint(traced)}
    candidates = [(s, slice_) for s in CANDIDATES] if traced.fsdp_units else []
    bigger = slice_
    for _ in range(LARGER_SLICES):
        bigger = bigger.larger() if bigger is not None else None
        if bigger is not None:
            candidates.append((Switches(), bigger))
    for switches, target in candidates:
        if compiles >= budget or sum(a.fits for a in found) >= wanted:
            break
        try:
            candidate = trace(fn, args, target.chips, max_graphs, switches)
        except LaunchError as exc:
            if isinstance(exc.__cause__, NotApplicable):
                continue
            raise
        if target == slice_ and _fingerprint(candidate) in seen:
            continue            # the switch was on already: the same program
        seen.add(_fingerprint(candidate))
        compiles += 1
        planned = report(candidate, target)
        found.append(_alternative(switches, target, planned))
    return found


def _fingerprint(traced: TracedStep) -> tuple:
    return tuple(g.fingerprint for g in traced.graphs)


def _alternative(switches: Switches, target: Topology, planned: TpuReport) -> Alternative:
    host_ok = planned.host_memory is None or planned.host_memory.fits
    step: Optional[float] = planned.step_seconds
    if step is not None:
        step *= switches.batch_divisor
    what = str(switches) if switches.any else "as written"
    if not host_ok:
        what += " (the optimizer state exceeds the VM's host memory)"
    return Alternative(what, planned.fits and host_ok, planned.peak_bytes,
                       planned.required_bytes, step, target.cloud_name)
