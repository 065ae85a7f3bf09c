"""See a training step as a TPU sees it, without a TPU: the step traced here, compiled by
Google's TPU compiler (libtpu) for a named slice, and what the compiler says of it (memory
per chip, FLOPs and collectives and how its schedule overlaps them), with a step time
estimated from that schedule.

    from xla_fsdp.aot import compile_for_tpu
    report = compile_for_tpu(train, "v5e-8", args=(config,))
    print(report)            # a table; report.fits, report.peak_bytes, report.estimate, ...

From the command line, an unchanged training script whose ``launch(...)`` is compiled
instead of run: ``python -m xla_fsdp.aot --topology v5e:2x4 train.py [args]``. The compiler
needs Python >= 3.12 and installs beside this package: ``python -m xla_fsdp.aot install``.
``planning()`` is true in the process that traces a plan (values read there are zeros and
checkpoints are absent), for scripts that want to say so.
"""
from .._xla.trace_only import active as planning
from .plan import CompileFailed, NoTrainingStep, compile_for_tpu
from .report import TpuReport
from .step_time import Efficiency, StepTime, estimate
from .topology import known_names, resolve
from .tpu_compiler import CompilerNotInstalled
from .tpu_schedule import Collective

__all__ = ["compile_for_tpu", "TpuReport", "StepTime", "Efficiency", "estimate", "Collective",
           "CompilerNotInstalled", "CompileFailed", "NoTrainingStep", "known_names", "resolve",
           "planning"]
