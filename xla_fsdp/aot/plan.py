"""``compile_for_tpu``: a training function's steady step, traced here, compiled by libtpu
for a TPU slice, reported."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence

from ..launch.runner import LaunchError, picklable_call, run_device_process
from . import step_time, tpu_compiler
from .alternatives import search
from .report import TRAINING, HostMemory, TpuReport
from .topology import Topology, resolve
from .tpu_schedule import collectives, traced_collectives
from .traced import process
from .traced.process import TracedStep
from .traced.switches import Switches

STEPS = ("train", "eval")


class CompileFailed(RuntimeError):
    """libtpu refused the traced step for a reason other than its size (the first line of
    its message says which, e.g. a LIBTPU_INIT_ARGS flag it does not take)."""

    def __init__(self, message: str) -> None:
        first = message.strip().splitlines()[0] if message.strip() else "no message"
        super().__init__(f"libtpu could not compile the traced step: {first}")
        self.compiler_message = message


class NoTrainingStep(RuntimeError):
    """The traced function reached no training step (see [Note: a training step])."""

    def __init__(self, message: str, traced: TracedStep) -> None:
        super().__init__(message)
        self.traced = traced


def trace_step(fn: Callable[..., Any], args: Sequence[Any], world: int,
               max_graphs: int = 12, switches: Switches = Switches()) -> TracedStep:
    """Runs ``fn(0, *args)`` in a traced process standing for ``world`` ranks (see [Note:
    one traced rank stands for the world]), with ``switches`` on its units, and returns its
    steady step's graphs."""
    payload = picklable_call(fn, tuple(args))
    try:
        results = run_device_process(process.main, (payload, world, max_graphs, switches),
                                     process.environment(world))
    except LaunchError as exc:
        if "buffer is null" not in str(exc) and "placeholder" not in str(exc):
            raise
        raise LaunchError(
            "xla_fsdp.aot: the traced function needed a value that only running the step "
            "would give (torch_xla read a placeholder, which aborts), e.g. a data-dependent "
            "op that torch_xla computes on the CPU, or a read this planner does not turn "
            f"into zeros. The traced process said:\n{exc}") from exc
    return results[0]


def compile_for_tpu(fn: Callable[..., Any], topology: str, args: Sequence[Any] = (), *,
                    max_graphs: int = 12, step: str = "train",
                    alternatives: int = 2, search_budget: int = 8) -> TpuReport:
    """Compiles the steady training step of ``fn`` for the TPU slice ``topology`` with
    libtpu, on this machine, and reports what the compiler says.

    ``fn(rank, *args)`` is what you would pass to ``xla_fsdp.launch``. It runs once, as
    rank 0 of a world with as many ranks as the slice has chips, and nothing it traces is
    executed: a model built on the meta device is planned without its values, in little
    memory. Its steps are traced until one repeats (giving up after ``max_graphs`` different
    graphs); the repeated step's program is compiled. Values the function reads on the
    host are zeros, and checkpoints read as absent.

    ``step="train"`` (the default) plans a training step only: a steady program without a
    backward pass or an update raises ``NoTrainingStep`` before anything is compiled.
    ``step="eval"`` plans whatever the function repeats, an evaluation loop included.

    A step that does not fit the chip's HBM is reported with ``fits=False``, the
    compiler's message and, in ``alternatives``, configurations tried instead until
    ``alternatives`` of them fit or ``search_budget`` were compiled (see [Note: what would
    fit]; 0 tries none); this never raises for that. It raises ValueError for an unknown
    topology (naming the known ones), ``tpu_compiler.CompilerNotInstalled`` without the
    compiler, and ``LaunchError`` when ``fn`` fails.
    """
    if step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, not {step!r}")
    slice_ = resolve(topology)
    tpu_compiler.compiler_python()   # installed, before minutes of tracing
    traced = trace_step(fn, args, slice_.chips, max_graphs)
    require_step(traced, step)
    report = report_for(traced, slice_)
    if not report.fits and alternatives > 0:
        report = dataclasses.replace(report, alternatives=search(
            fn, args, slice_, traced, trace_step, report_for, alternatives, search_budget,
            max_graphs))
    return report


def require_step(traced: TracedStep, step: str) -> None:
    """Raises ``NoTrainingStep`` when ``step`` is "train" and the traced step is not one."""
    if step == "train" and traced.graphs and traced.kind != TRAINING:
        how = (f"the function returned after {traced.syncs} syncs" if traced.returned else
               f"its steady program ({len(traced.graphs)} graph(s) after {traced.syncs} "
               f"syncs)")
        what = {"forward only": "ran no backward pass",
                "backward only": "ran backward passes but no optimizer step or update"}
        raise NoTrainingStep(
            f"xla_fsdp.aot: no training step to plan: {how} {what[traced.kind]}. A plan "
            f"traces the script until a training step repeats; a script that only evaluates, "
            f"or has nothing left to train, has none. To plan its evaluation on purpose, "
            f"pass --step eval (compile_for_tpu(..., step='eval')).", traced)


def report_for(traced: TracedStep, slice_: Topology) -> TpuReport:
    """Compiles the traced step's graphs for ``slice_`` and reports them."""
    if not traced.graphs:
        raise NoTrainingStep(
            f"xla_fsdp.aot: the function traced no step to compile: no XLA work was "
            f"pending at any of its {traced.syncs} syncs, nor when it returned", traced)
    replicas, partitions = (1, slice_.chips) if traced.spmd else (slice_.chips, 1)
    programs = [tpu_compiler.Program(g.hlo, replicas, partitions) for g in traced.graphs]
    compilation = tpu_compiler.compile_programs(slice_.name, programs)
    compiled = compilation.programs
    refused = any(c.status == "oom" for c in compiled)
    failed = [c for c in compiled if c.status == "error"]
    if failed:
        raise CompileFailed(failed[0].message)
    ok = [c for c in compiled if c.memory]
    # the program with the highest peak
    memory = max((c.memory for c in ok), key=lambda m: m["peak_memory_in_bytes"], default={})
    found = []
    for graph, c in zip(traced.graphs, compiled):
        if c.optimized_hlo:
            found += collectives(c.optimized_hlo, slice_.chips, traced_collectives(graph.hlo))
    coords = [c[:len(slice_.grid)] for c in compilation.coords]
    optimized = [c.optimized_hlo for c in compiled]
    estimate = None if refused else step_time.estimate_programs(optimized, slice_,
                                                                coords=coords)
    oom = next((c for c in compiled if c.oom or c.status == "oom"), None)
    return TpuReport(
        topology=slice_, fits=not refused, hbm_bytes=slice_.chip.hbm_bytes,
        usable_hbm_bytes=compilation.usable_hbm_bytes or (
            oom.oom.get("available_bytes", 0) if oom else 0),
        peak_bytes=memory.get("peak_memory_in_bytes", 0),
        argument_bytes=memory.get("argument_size_in_bytes", 0),
        output_bytes=memory.get("output_size_in_bytes", 0),
        alias_bytes=memory.get("alias_size_in_bytes", 0),
        temp_bytes=memory.get("temp_size_in_bytes", 0),
        flops=sum(c.cost.get("flops", 0.0) for c in ok),
        bytes_accessed=sum(c.cost.get("bytes accessed", 0.0) for c in ok),
        collectives=found, programs=len(compiled),
        message=oom.message if oom else "",
        required_bytes=oom.oom.get("required_bytes", 0) if oom else 0,
        compile_seconds=sum(c.compile_seconds for c in compiled),
        notes=_notes(traced), hlo=[g.hlo for g in traced.graphs], step_kind=traced.kind,
        estimate=estimate, model_flops=traced.model_flops,
        host_memory=host_memory(traced, slice_), optimized_hlo=optimized, coords=coords)


def host_memory(traced: TracedStep, slice_: Topology) -> Optional[HostMemory]:
    """What an offloaded optimizer keeps on one TPU VM's host (None: nothing offloaded):
    the traced rank's host state times the chips that VM hosts."""
    if not traced.host_state_bytes:
        return None
    vm = slice_.host_vm()
    chips = min(vm.chips, slice_.chips)
    return HostMemory(vm.machine_type, chips, vm.memory_bytes,
                      traced.host_state_bytes * chips, vm.source)


def _notes(traced: TracedStep) -> List[str]:
    notes = []
    if not traced.repeated:
        notes.append(
            f"no step repeated within {traced.syncs} syncs ({len(traced.graphs)} graphs)"
            + (" (the function returned)" if traced.returned else "")
            + ": the last sync's graph was compiled, which may not be the steady step")
    if len(traced.graphs) > 1:
        notes.append(f"a step is {len(traced.graphs)} programs (the function syncs more than "
                     f"once per step): peak is the largest, FLOPs, bytes and times are summed")
    untracked = sum(g.untracked for g in traced.graphs)
    if untracked:
        notes.append(f"{untracked} pending tensor(s) were not reachable from Python: they "
                     f"are not in the planned program, which may differ from the real one")
    if traced.host_reads:
        notes.append(f"the function read {traced.host_reads} value(s) on the host; in a plan "
                     f"they read as zeros")
    return notes
