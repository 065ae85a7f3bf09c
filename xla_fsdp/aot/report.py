"""What libtpu says about a step compiled for a TPU slice, the step-time estimate made from
its schedule, and the table that shows both. Pure: the figures come in, a table goes out.

[Note: model FLOPs and hardware FLOPs] Two utilizations are reported, as MaxText and
torchprime report them:
* MFU, model FLOPs utilization: the model's FLOPs per chip and step over the estimated
  step time at the chip's bf16 peak. The model's FLOPs are three times its forward pass's
  matmul FLOPs (the forward, and the backward's two matmuls for each), counted as the
  traced step issued them (``traced.model_flops``): 6 x matmul parameters x tokens for a
  transformer's weights, plus attention. Recomputation and the optimizer are not model
  FLOPs; causal attention kernels count half their square (the masked half is never
  computed), attention written as matmuls over a mask counts whole, as it is computed;
* HFU, hardware FLOPs utilization: every matmul FLOP the compiled program executes,
  recomputation, the optimizer and extra float32 passes included, over the same time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from .step_time import StepTime, describe
from .topology import Topology
from .tpu_schedule import Collective

GIB = 2 ** 30
TRAINING = "training"


@dataclass(frozen=True)
class HostMemory:
    """What an offloaded optimizer keeps in the host memory of one TPU VM."""
    vm: str                      # its machine type
    chips: int                   # chips it hosts
    memory_bytes: int            # its memory, as published
    state_bytes: int             # shards, gradients and optimizer state of its chips
    source: str

    @property
    def fits(self) -> bool:
        return self.state_bytes <= self.memory_bytes


@dataclass(frozen=True)
class Alternative:
    """A configuration the planner tried because the step did not fit."""
    description: str
    fits: bool
    peak_bytes: int
    required_bytes: int
    step_seconds: Optional[float]
    topology: str


@dataclass
class TpuReport:
    """libtpu's account of one training step on one chip of ``topology``.

    Byte figures are per chip, from the compiler. ``fits`` is the compiler's verdict. When
    the step does not fit, ``message`` is the compiler's refusal and ``required_bytes`` the
    memory it says the step needs; libtpu gives no other figures for a program it refuses,
    so the others are zero. ``estimate`` is the step-time model's (see [Note: the step-time
    model] in ``step_time``), ``model_flops`` the model's FLOPs per chip and step (see
    [Note: model FLOPs and hardware FLOPs])."""
    topology: Topology
    fits: bool
    hbm_bytes: int                 # the chip's HBM, as published
    usable_hbm_bytes: int          # what the compiler lets one program use
    peak_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    bytes_accessed: float
    collectives: List[Collective]
    programs: int = 1              # programs per step (a function that syncs more often)
    message: str = ""
    required_bytes: int = 0
    compile_seconds: float = 0.0
    notes: List[str] = field(default_factory=list)
    hlo: List[str] = field(default_factory=list, repr=False)  # the traced programs compiled
    step_kind: str = TRAINING
    estimate: Optional[StepTime] = None
    model_flops: float = 0.0
    host_memory: Optional[HostMemory] = None
    alternatives: List[Alternative] = field(default_factory=list)
    # libtpu's scheduled programs, and where each replica's (partition's) chip sits
    optimized_hlo: List[str] = field(default_factory=list, repr=False)
    coords: List[List[int]] = field(default_factory=list, repr=False)

    # -- derived ---------------------------------------------------------------------------
    @property
    def collective_bytes(self) -> float:
        return sum(c.bytes_per_chip for c in self.collectives)

    @property
    def step_seconds(self) -> Optional[float]:
        return self.estimate.seconds if self.estimate is not None else None

    @property
    def mfu(self) -> Optional[float]:
        """Model FLOPs utilization (see [Note: model FLOPs and hardware FLOPs])."""
        return self._utilization(self.model_flops)

    @property
    def hfu(self) -> Optional[float]:
        """Hardware FLOPs utilization (see [Note: model FLOPs and hardware FLOPs])."""
        return self._utilization(self.estimate.mxu_flops if self.estimate else 0.0)

    def _utilization(self, flops: float) -> Optional[float]:
        seconds = self.step_seconds
        if not seconds or not flops:
            return None
        return flops / (seconds * self.topology.chip.peak_bf16_flops)

    def collective_summary(self) -> Dict[str, Dict[str, float]]:
        """Per kind: how many, bytes per chip, how many the schedule overlaps."""
        out: Dict[str, Dict[str, float]] = {}
        for c in self.collectives:
            entry = out.setdefault(c.kind, {"count": 0, "bytes": 0.0, "overlapped": 0,
                                            "asynchronous": 0})
            entry["count"] += c.count
            entry["bytes"] += c.bytes_per_chip
            entry["overlapped"] += c.count if c.overlapped else 0
            entry["asynchronous"] += c.count if c.asynchronous else 0
        return out

    # -- the table -------------------------------------------------------------------------
    def __str__(self) -> str:
        kind = "" if self.step_kind == TRAINING else f" ({self.step_kind.upper()} step)"
        lines = [f"TPU plan for {self.topology}{kind}: "
                 + ("fits" if self.fits else "DOES NOT FIT")
                 + f" (libtpu, compiled in {self.compile_seconds:.1f} s; the compiler's "
                   f"figures, not a measurement)"]
        memory = [("HBM the compiler allows one program", self.usable_hbm_bytes),
                  ("HBM per chip (published, rounded)", self.hbm_bytes)]
        if not self.fits and self.required_bytes:
            memory.insert(0, ("required (compiler)", self.required_bytes))
        if self.peak_bytes:
            allocated = (self.argument_bytes + self.output_bytes - self.alias_bytes
                         + self.temp_bytes)
            # the peak first; the parts add up to what is allocated, which is more than the
            # peak because buffers that are never live together share memory
            memory = [("peak per chip", self.peak_bytes)] + memory + [
                ("allocated in all (not all live at once)", allocated),
                ("  arguments", self.argument_bytes),
                ("  outputs", self.output_bytes),
                ("  less outputs aliased in donated arguments", -self.alias_bytes),
                ("  temporaries", self.temp_bytes),
                ("HBM bytes accessed per chip", self.bytes_accessed)]
        unit = _unit([v for _, v in memory])
        rows = [(name, _bytes(v, unit)) for name, v in memory]
        if self.peak_bytes:
            rows.append(("FLOPs per chip", f"{self.flops:.4g}"))
        lines += _table(["", ""], rows)
        if self.collectives:
            lines.append("")
            summary = self.collective_summary()
            unit = _unit([v["bytes"] for v in summary.values()])
            lines += _table(["collective", "count", "bytes per chip", "asynchronous",
                             "overlapped with compute"],
                            [(k, f"{int(v['count'])}", _bytes(v["bytes"], unit),
                              f"{int(v['asynchronous'])}", f"{int(v['overlapped'])}")
                             for k, v in sorted(summary.items())])
        lines += self._estimate_lines()
        lines += self._host_lines()
        lines += self._alternative_lines()
        if self.message:
            lines += ["", "Compiler: " + self.message.strip().splitlines()[0]]
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _estimate_lines(self) -> List[str]:
        e = self.estimate
        if e is None or not e.seconds:
            return []
        rows = [("step time (estimate)", _time(e.seconds)),
                ("  the TensorCore's instructions", _time(e.busy_seconds)),
                ("    of which matmul-bound (sum of matmul times)", _time(e.matmul_seconds)),
                ("    of which HBM-bound (sum of HBM times)", _time(e.memory_seconds)),
                ("  waiting for collectives", _time(e.exposed_collective_seconds)),
                ("  waiting for host transfers", _time(e.exposed_host_seconds)),
                ("collectives over ICI, in all", _time(e.collective_seconds))]
        if self.mfu is not None:
            rows.append(("MFU (model FLOPs)", f"{100 * self.mfu:.1f}%"))
        if self.hfu is not None:
            rows.append(("HFU (hardware FLOPs, recomputation included)",
                         f"{100 * self.hfu:.1f}%"))
        lines = ["", f"Step-time estimate ({describe(e.efficiency)}):"]
        lines += _table(["", ""], rows)
        if e.multipass_flops:
            lines.append(f"{100 * e.multipass_flops / max(e.dot_flops, 1):.0f}% of the matmul "
                         f"FLOPs are float32 at HIGH or HIGHEST precision: 3 or 6 bf16 passes "
                         f"each (torch_xla's mat_mul_precision)")
        if e.kernels_without_cost:
            lines.append(f"{e.kernels_without_cost} Pallas kernel(s) carry no cost estimate: "
                         f"counted by their HBM bytes only")
        return lines

    def _host_lines(self) -> List[str]:
        h = self.host_memory
        if h is None:
            return []
        verdict = "fits" if h.fits else "DOES NOT FIT"
        state = _bytes(h.state_bytes, _unit([h.state_bytes]))
        return ["", f"Host memory (offload_optimizer): {state} of optimizer state, "
                    f"shards and gradients for the {h.chips} chip(s) of one {h.vm} VM, which "
                    f"has {h.memory_bytes / 1e9:.0f} GB: {verdict} ({h.source})"]

    def _alternative_lines(self) -> List[str]:
        if not self.alternatives:
            return []
        unit = _unit([a.peak_bytes if a.fits else a.required_bytes for a in self.alternatives])
        rows = [(a.description, a.topology, "yes" if a.fits else "no",
                 _bytes(a.peak_bytes, unit) if a.fits
                 else f"needs {_bytes(a.required_bytes, unit)}",
                 _time(a.step_seconds) if a.step_seconds else "-")
                for a in self.alternatives]
        return ["", "What would fit (each compiled by libtpu):"] + _table(
            ["configuration", "slice", "fits", "peak per chip", "step (estimate)"], rows)


def _unit(values) -> str:
    """One unit for a table's byte figures: GiB unless one of them would read 0.0x GiB."""
    sizes = [abs(v) for v in values if v]
    return "GiB" if not sizes or min(sizes) >= GIB / 10 else "MiB"


def _bytes(n: float, unit: str) -> str:
    return f"{n / (GIB if unit == 'GiB' else 2 ** 20):.2f} {unit}"


def _time(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def _table(header: List[str], rows: List[tuple]) -> List[str]:
    widths = [max(len(str(r[i])) for r in [tuple(header)] + rows) for i in range(len(header))]

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return ([line(header), rule] if any(header) else []) + [line(r) for r in rows]
