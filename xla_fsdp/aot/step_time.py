"""How long a step takes on a TPU slice, estimated from libtpu's scheduled program. Pure:
the optimized HLO text and the slice in, seconds out; no jax, no torch.

[Note: the step-time model] A TPU's TensorCore runs the instructions of a scheduled
program one after another, in the order libtpu printed them; the ICI moves collectives'
data and DMA engines move data to and from the host beside it. So the estimate replays the
schedule on two clocks:
* each instruction takes the longer of its matmul time and its HBM time (a roofline per
  instruction, not per step): its dots' FLOPs at the chip's bf16 peak, times the passes
  their precision needs (a float32 dot at HIGH runs 3 bf16 passes, at HIGHEST 6, at DEFAULT
  1), and the bytes it reads from and writes to HBM (operands and results not held in
  on-chip memory; of an operand it only slices, the slices; of an asynchronous slice, a DMA
  that brings part of an operand on chip ahead of its reader, that part, once) at the
  chip's HBM bandwidth.
  Both rates are scaled by achievable fractions fitted on measured runs (``Efficiency``,
  ``CALIBRATED``). A Pallas kernel (a ``tpu_custom_call``) is costed by the estimate its
  lowering attached, or, an attention kernel without one (jax's splash kernels carry
  none), by its name and shapes as causal attention (``attention_kernel_cost``);
* a collective starts with its first piece in the schedule and must have finished by its
  last. Its transfer takes, as the scaling book models it (see [Note: links and
  wraparound]), ``(n-1)/n`` of the bytes it moves over the bandwidth of the torus axes
  its rank group spans (each axis: one link one way without a wraparound, both ways with
  one), and at least one microsecond per hop of the longest path. An all-gather moves its
  result, a reduce-scatter its operand, an all-reduce twice its result, an all-to-all a
  quarter of the group's results (each byte goes to one chip, on average a quarter of the
  way round a ring); transfers queue
  on the ICI one at a time. A transfer to or from host memory queues likewise on the host
  link;
* the step is the time the TensorCore's clock reaches the end. What the collectives add is
  the time it spent waiting at their ends: an overlapped collective costs only the part of
  its transfer the compute scheduled beside it does not cover.
Loops run their body ``known_trip_count`` times (three are replayed, the rest extrapolated);
a conditional takes its slowest branch. Not modelled: vector-unit work that is neither
matmul nor HBM-bound, per-instruction launch overhead, ICI contention between concurrent
collectives on different axes, and anything libtpu does at run time that its schedule does
not show. It is an estimate; ``CALIBRATED`` says how close it came to measured runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Sequence, Tuple

from .._xla.hlo_text import Instruction, parse_module
from .instruction_cost import Costs, host_transfer_bytes
from .topology import SCALING_BOOK, Topology
from .tpu_schedule import Scheduled, moved_bytes, scheduled_collectives, trip_count

HOP_SECONDS = 1e-6            # per ICI hop (scaling book: "typically around 1us")
HOST_LINK_BYTES_PER_S = {"v5e": 1.6e10, "v5p": 1.6e10, "v6e": 3.2e10}  # PCIe per chip, book
_REPLAYED_ITERATIONS = 3


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of a chip's peaks: ``matmul`` of its bf16 FLOP/s, ``memory`` of
    its HBM bandwidth, ``collective`` of its ICI links' bandwidth."""
    matmul: float = 1.0
    memory: float = 1.0
    collective: float = 1.0
    source: str = "the published peaks"


# Fitted on three measured runs, by ``python -m scripts.bench.tpu_calibration``: torchprime's
# e2e Llama 3.0 8B (flash) and 3.1 8B (splash) on a v6e-4, MaxText's Llama 3.1 8B recipe on
# a v6e-8 (benchmarks/results/tpu_calibration/calibration.md gives every row's error)
CALIBRATED = Efficiency(matmul=0.60, memory=0.70, collective=1.0,
                        source="fitted on 3 measured v6e runs, errors -10%, +1%, +11%")


@dataclass
class StepTime:
    """The estimate for one program (see [Note: the step-time model]); seconds unless
    named otherwise."""
    seconds: float = 0.0
    busy_seconds: float = 0.0             # the TensorCore's instructions
    matmul_seconds: float = 0.0           # of those, their matmul time
    memory_seconds: float = 0.0           # of those, their HBM time
    collective_seconds: float = 0.0       # every collective's transfer
    exposed_collective_seconds: float = 0.0  # the TensorCore waiting for collectives
    host_transfer_seconds: float = 0.0    # transfers to and from host memory
    exposed_host_seconds: float = 0.0     # the TensorCore waiting for them
    dot_flops: float = 0.0                # matmul FLOPs, one pass each
    mxu_flops: float = 0.0                # with every pass their precision needs
    multipass_flops: float = 0.0          # of dot_flops, those run in several passes
    hbm_bytes: float = 0.0
    kernels_without_cost: int = 0         # Pallas kernels whose FLOPs are unknown
    efficiency: Efficiency = field(default_factory=Efficiency)

    def add(self, other: "StepTime", times: float = 1.0) -> None:
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + times * getattr(other, name))


_SUMMED = tuple(f.name for f in fields(StepTime) if f.name != "efficiency")


class Schedule:
    """One scheduled program, read once: what each instruction costs, which collectives
    start and end where. ``estimate`` replays it at any rates (a calibration tries many)."""

    def __init__(self, optimized_hlo: str, topology: Topology,
                 coords: Optional[Sequence[Sequence[int]]] = None) -> None:
        self.computations, self.entry = parse_module(optimized_hlo)
        self.topology = topology
        self.coords = [tuple(c) for c in coords] if coords else None
        self.costs = Costs(self.computations)
        self._memo: Dict[str, Tuple[List[Instruction], bool]] = {}
        self._collectives: Dict[str, List[Tuple[Scheduled, List[Tuple[int, ...]]]]] = {}

    def collectives(self, computation: str) -> List[Tuple[Scheduled, List[Tuple[int, ...]]]]:
        """The collectives of ``computation``, each with the grid positions of the chips of
        one of its rank groups."""
        if computation not in self._collectives:
            self._collectives[computation] = [
                (c, self._rank_group(c.piece)) for c in
                scheduled_collectives(self.computations, computation, self._memo)]
        return self._collectives[computation]

    def _rank_group(self, piece: Instruction) -> List[Tuple[int, ...]]:
        rank_groups = piece.replica_groups
        members = rank_groups[0] if rank_groups else range(self.topology.chips)
        return [self.coords[i] if self.coords is not None and i < len(self.coords)
                else self.topology.coords(i) for i in members]

    def estimate(self, efficiency: Efficiency = CALIBRATED) -> StepTime:
        if self.entry is None:
            return StepTime(efficiency=efficiency)
        replay = _Replay(self, efficiency)
        total = replay.run(self.entry)
        total.seconds = replay.clock
        total.efficiency = efficiency
        return total


def estimate(optimized_hlo: str, topology: Topology, efficiency: Efficiency = CALIBRATED,
             coords: Optional[Sequence[Sequence[int]]] = None) -> StepTime:
    """The step time of ``optimized_hlo`` (libtpu's scheduled module, one program) on
    ``topology``. ``coords[i]``: the grid position of the chip that runs replica (or
    partition) ``i``; by default chips are numbered with the first grid axis fastest."""
    return Schedule(optimized_hlo, topology, coords).estimate(efficiency)


def estimate_programs(optimized_hlos: Sequence[str], topology: Topology,
                      efficiency: Efficiency = CALIBRATED,
                      coords: Optional[Sequence[Sequence[int]]] = None) -> StepTime:
    """The step time of a step made of several programs run one after the other."""
    total = StepTime(efficiency=efficiency)
    for hlo in optimized_hlos:
        total.add(estimate(hlo, topology, efficiency, coords))
    return total


def collective_seconds(opcode: str, result_bytes: float, rank_group: Sequence[Tuple[int, ...]],
                       topology: Topology, efficiency: Efficiency = CALIBRATED) -> float:
    """The ICI time of one collective: ``opcode`` as libtpu emitted it, the bytes of its
    result, the grid positions of the chips of one of its rank groups (see [Note: the
    step-time model])."""
    n = len(rank_group)
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    moved = {"all-gather": result_bytes, "reduce-scatter": result_bytes * n,
             "all-reduce": 2 * result_bytes, "all-to-all": result_bytes * n / 4,
             "ragged-all-to-all": result_bytes * n / 4, "collective-broadcast": result_bytes}
    link = topology.chip.ici_link_bytes_per_s * efficiency.collective
    if opcode not in moved:    # a permute: each chip sends its buffer to one neighbour
        return max(HOP_SECONDS, result_bytes / link)
    bandwidth, hops = 0.0, 0
    for axis in range(len(topology.grid)):
        extent = len({c[axis] for c in rank_group})
        if extent <= 1:
            continue
        ring = extent == topology.grid[axis] and topology.wraparound(axis)
        bandwidth += link * (2 if ring else 1)
        hops += math.ceil(extent / 2) if ring else extent - 1
    if bandwidth == 0:
        return 0.0
    return max(HOP_SECONDS * hops, share * moved[opcode] / bandwidth)


# -- the replay -------------------------------------------------------------------------------
class _Replay:
    """Walks a schedule on the TensorCore's clock (see [Note: the step-time model])."""

    def __init__(self, schedule: Schedule, efficiency: Efficiency) -> None:
        self.schedule = schedule
        self.efficiency = efficiency
        self.clock = self.ici_free = self.host_free = 0.0
        chip = schedule.topology.chip
        self.matmul_rate = chip.peak_bf16_flops * efficiency.matmul
        self.memory_rate = chip.hbm_bytes_per_s * efficiency.memory
        self.host_rate = HOST_LINK_BYTES_PER_S.get(chip.generation, 1.6e10)

    def run(self, computation: str) -> StepTime:
        """Replays ``computation`` from the current clock; returns what it added."""
        steps = self.schedule.computations.get(computation, [])
        starts: Dict[int, List[Tuple[Scheduled, List[Tuple[int, ...]]]]] = {}
        ends: Dict[int, List[Scheduled]] = {}
        for c, rank_group in self.schedule.collectives(computation):
            starts.setdefault(c.first, []).append((c, rank_group))
            ends.setdefault(c.last, []).append(c)
        added = StepTime()
        finishes: Dict[str, float] = {}
        host: Dict[str, float] = {}
        for i, ins in enumerate(steps):
            for c, rank_group in starts.get(i, []):
                opcode, result = moved_bytes(c.piece)
                seconds = collective_seconds(opcode, result, rank_group, self.schedule.topology,
                                             self.efficiency)
                self.ici_free = max(self.clock, self.ici_free) + seconds
                finishes[c.key] = self.ici_free
                added.collective_seconds += seconds
            moved = host_transfer_bytes(ins)
            if moved:
                seconds = moved / self.host_rate
                self.host_free = max(self.clock, self.host_free) + seconds
                host[ins.name] = self.host_free
                added.host_transfer_seconds += seconds
            elif ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in host:
                wait = max(0.0, host[ins.operands[0]] - self.clock)
                self.clock += wait
                added.exposed_host_seconds += wait
            if ins.opcode == "while":
                added.add(self._loop(ins, trip_count(ins, self.schedule.computations, steps)))
            elif ins.opcode == "conditional":
                added.add(self._slowest_branch(ins))
            elif ins.opcode == "call":
                for callee in ins.callees:
                    added.add(self.run(callee))
            else:
                self._compute(ins, computation, added)
            for c in ends.get(i, []):
                wait = max(0.0, finishes.get(c.key, self.clock) - self.clock)
                self.clock += wait
                added.exposed_collective_seconds += wait
        return added

    def _compute(self, ins: Instruction, computation: str, added: StepTime) -> None:
        work = self.schedule.costs.of(ins, computation)
        matmul = work.mxu_flops / self.matmul_rate
        memory = work.hbm_bytes / self.memory_rate
        seconds = max(matmul, memory)
        self.clock += seconds
        added.busy_seconds += seconds
        added.matmul_seconds += matmul
        added.memory_seconds += memory
        for f in fields(work):
            setattr(added, f.name, getattr(added, f.name) + getattr(work, f.name))

    def _loop(self, ins: Instruction, trips: int) -> StepTime:
        body = (ins.attr("body") or "").lstrip("%")
        added = StepTime()
        last = StepTime()
        before = self.clock
        for _ in range(min(trips, _REPLAYED_ITERATIONS)):
            start = self.clock
            last = self.run(body)
            last.seconds = self.clock - start
            added.add(last)
        rest = trips - min(trips, _REPLAYED_ITERATIONS)
        if rest:
            added.add(last, rest)
            self.clock += rest * last.seconds
            self.ici_free = max(self.ici_free + rest * last.seconds, self.clock)
            self.host_free = max(self.host_free + rest * last.seconds, self.clock)
        added.seconds = self.clock - before
        return added

    def _slowest_branch(self, ins: Instruction) -> StepTime:
        start, ici, host = self.clock, self.ici_free, self.host_free
        best, best_end = StepTime(), start
        for branch in ins.callees:
            self.clock, self.ici_free, self.host_free = start, ici, host
            added = self.run(branch)
            if self.clock >= best_end:
                best, best_end, end_state = added, self.clock, (self.ici_free, self.host_free)
        if ins.callees:
            self.clock = best_end
            self.ici_free, self.host_free = end_state
        return best


def describe(efficiency: Efficiency) -> str:
    """One line saying which rates the estimate used."""
    if (efficiency.matmul, efficiency.memory, efficiency.collective) == (1.0, 1.0, 1.0):
        return f"published peaks, ICI per link from {SCALING_BOOK}"
    return (f"{100 * efficiency.matmul:.0f}% of the matmul peak, {100 * efficiency.memory:.0f}% "
            f"of HBM bandwidth, {100 * efficiency.collective:.0f}% of ICI ({efficiency.source})")


