"""What libtpu says about a step compiled for a TPU slice, and a roofline estimate from it.
Pure: the figures come in, a table goes out.

[Note: the roofline estimate] The estimate is the compiler's counts divided by the chip's
published rates (``topology.Chip``, with the page that states them), not a measurement:
* compute: the compiler's FLOPs per chip at the chip's bf16 peak. Matmuls in float32 run
  as several bf16 passes on a TPU, so a float32 step takes longer than this;
* memory: the compiler's HBM bytes accessed per chip at the published HBM bandwidth;
* communication: the bytes each chip sends for its collectives (ring algorithm, see
  ``tpu_schedule.bytes_sent_per_chip``) at the chip's bidirectional ICI bandwidth, i.e.
  as if a collective kept every link busy both ways;
* compute and memory traffic overlap perfectly (the larger of the two counts); a
  collective the TPU schedule overlaps with compute is hidden behind it, one it runs
  synchronously adds its whole time.
So the estimate is a lower bound of the step time under those rates, and MFU is the
compiler's FLOPs (recomputation and the optimizer included, per chip) over that time, as a
fraction of the bf16 peak.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .topology import Topology
from .tpu_schedule import Collective

GIB = 2 ** 30


@dataclass(frozen=True)
class Roofline:
    compute_seconds: float
    memory_seconds: float
    collective_seconds: float         # every collective's ICI time
    exposed_collective_seconds: float  # of those the schedule runs synchronously
    step_seconds: float
    mfu: float


@dataclass
class TpuReport:
    """libtpu's account of one training step on one chip of ``topology``.

    Byte figures are per chip, from the compiler. ``fits`` is the compiler's verdict. When
    the step does not fit, ``message`` is the compiler's refusal and ``required_bytes`` the
    memory it says the step needs; libtpu gives no other figures for a program it refuses,
    so the others are zero."""
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

    # -- derived ---------------------------------------------------------------------------
    @property
    def collective_bytes(self) -> float:
        return sum(c.bytes_per_chip for c in self.collectives)

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

    def roofline(self) -> Optional[Roofline]:
        """The step time estimate (see [Note: the roofline estimate]); None without figures."""
        if not self.flops and not self.bytes_accessed:
            return None
        chip = self.topology.chip
        compute = self.flops / chip.peak_bf16_flops
        memory = self.bytes_accessed / chip.hbm_bytes_per_s
        ici = self.collective_bytes / chip.ici_bytes_per_s
        exposed = sum(c.bytes_per_chip for c in self.collectives
                      if not c.overlapped) / chip.ici_bytes_per_s
        step = max(compute, memory) + exposed
        mfu = compute / step if step > 0 else 0.0
        return Roofline(compute, memory, ici, exposed, step, mfu)

    # -- the table -------------------------------------------------------------------------
    def __str__(self) -> str:
        chip = self.topology.chip
        lines = [f"TPU plan for {self.topology}: "
                 + ("fits" if self.fits else "DOES NOT FIT")
                 + f" (libtpu, compiled in {self.compile_seconds:.1f} s; the compiler's "
                   f"figures, not a measurement)"]
        rows = [("HBM per chip (published)", _gib(self.hbm_bytes)),
                ("HBM the compiler allows", _gib(self.usable_hbm_bytes))]
        if not self.fits and self.required_bytes:
            rows.append(("required (compiler)", _gib(self.required_bytes)))
        if self.peak_bytes:
            rows += [("peak per chip", _gib(self.peak_bytes)),
                     ("  arguments", _gib(self.argument_bytes)),
                     ("  outputs", _gib(self.output_bytes)),
                     ("  aliased (outputs in donated inputs)", _gib(self.alias_bytes)),
                     ("  temporaries", _gib(self.temp_bytes)),
                     ("FLOPs per chip", f"{self.flops:.4g}"),
                     ("HBM bytes accessed per chip", _gib(self.bytes_accessed))]
        lines += _table(["", ""], rows)
        if self.collectives:
            lines.append("")
            summary = self.collective_summary()
            lines += _table(["collective", "count", "bytes per chip", "asynchronous",
                             "overlapped with compute"],
                            [(k, f"{int(v['count'])}", _gib(v["bytes"]),
                              f"{int(v['asynchronous'])}", f"{int(v['overlapped'])}")
                             for k, v in sorted(summary.items())])
        roof = self.roofline()
        if roof is not None:
            lines += ["", f"Roofline estimate (chip figures from {chip.source}: "
                          f"{chip.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16, "
                          f"{chip.hbm_bytes_per_s / 1e9:.0f} GB/s HBM, "
                          f"{chip.ici_bytes_per_s / 1e9:.0f} GB/s ICI):"]
            lines += _table(["", ""], [
                ("compute (FLOPs at bf16 peak)", _ms(roof.compute_seconds)),
                ("HBM traffic", _ms(roof.memory_seconds)),
                ("collectives over ICI", _ms(roof.collective_seconds)),
                ("  of which not overlapped", _ms(roof.exposed_collective_seconds)),
                ("step time (lower bound)", _ms(roof.step_seconds)),
                ("MFU (compiler FLOPs)", f"{100 * roof.mfu:.1f}%")])
            lines.append("Assumes: every FLOP at the bf16 peak (float32 matmuls are slower), "
                         "compute and HBM traffic fully overlapped, collectives at full "
                         "bidirectional ICI bandwidth, hidden when the schedule overlaps "
                         "them with compute.")
        if self.message:
            lines += ["", "Compiler: " + self.message.strip().splitlines()[0]]
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / GIB:.3f} GiB" if n >= GIB / 100 else f"{n / 2 ** 20:.2f} MiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _table(header: List[str], rows: List[tuple]) -> List[str]:
    widths = [max(len(str(r[i])) for r in [tuple(header)] + rows) for i in range(len(header))]
    out = []
    if any(header):
        out.append("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
        out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        out.append("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    return out
