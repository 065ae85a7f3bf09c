"""Which hardware the programs this process builds are for: torch_xla's device type, except
while the planner traces a TPU's step on a CPU device (``xla_fsdp.aot``), when it is the TPU.

The wrapper reads it once per unit, at construction, to pick the defaults that depend on the
hardware (see [Note: defaults that depend on the hardware] in ``_unit/options.py``), so a
plan traces the program a TPU would be given, not the one this machine's CPU would.
"""
from __future__ import annotations

import logging
from typing import Optional

# Process-wide: the planner's traced process sets it before it builds anything, on its one
# thread; a launch's ranks (threads) that set it all set the same value.
_PLANNED_FOR: Optional[str] = None


def device_type() -> Optional[str]:
    """``"TPU"``, ``"NEURON"``, ``"CUDA"``, ``"CPU"``...: what the programs built now will run
    on (None when torch_xla has not been told and will fall back to the CPU)."""
    if _PLANNED_FOR is not None:
        return _PLANNED_FOR
    return torch_xla_device_type_quietly()


def plan_for(name: Optional[str]) -> None:
    """Makes ``device_type()`` answer ``name`` in this process (None: torch_xla's answer
    again). The planner's traced process calls it, and tests that compare a plan with the
    same step run here; nothing else should, since the defaults it changes are for a TPU."""
    global _PLANNED_FOR
    _PLANNED_FOR = name


def _not_the_cpu_fallback_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Defaulting to PJRT_DEVICE=CPU")


def torch_xla_device_type_quietly() -> Optional[str]:
    """torch_xla's device type, importing it if need be, without the "Defaulting to
    PJRT_DEVICE=CPU" warning its import logs when ``PJRT_DEVICE`` is unset and it finds no
    accelerator. Our entry points (the launcher, ``patch_torch_xla``) call it first: with no
    accelerator they run virtual CPU devices by design, which every command would otherwise
    open with a warning. torch_xla's choice of an accelerator is still logged."""
    logging.getLogger().addFilter(_not_the_cpu_fallback_notice)
    try:
        import torch_xla.runtime as xr  # its import picks a default device type
        return xr.device_type()
    finally:
        logging.getLogger().removeFilter(_not_the_cpu_fallback_notice)
