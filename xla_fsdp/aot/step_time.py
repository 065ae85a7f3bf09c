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
  on-chip memory; of an operand it only slices, the slices) at the chip's HBM bandwidth.
  Both rates are scaled by achievable fractions fitted on measured runs (``Efficiency``,
  ``CALIBRATED``). A Pallas kernel (a ``tpu_custom_call``) is costed by the estimate its
  lowering attached, if any;
* a collective starts with its first piece in the schedule and must have finished by its
  last. Its transfer takes, as the scaling book models it (see [Note: links and
  wraparound]), ``(n-1)/n`` of the bytes it moves over the bandwidth of the torus axes
  its rank group spans (each axis: one link one way without a wraparound, both ways with
  one), and at least one microsecond per hop of the longest path. An all-gather moves its
  result, a reduce-scatter its operand, an all-reduce twice its result; transfers queue
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

import json
import math
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .._xla.hlo_text import Instruction, parse_module
from .topology import SCALING_BOOK, Topology
from .tpu_schedule import (COLLECTIVE_OPS, Scheduled, moved_bytes, scheduled_collectives,
                           trip_count)

HOP_SECONDS = 1e-6            # per ICI hop (scaling book: "typically around 1us")
HOST_LINK_BYTES_PER_S = {"v5e": 1.6e10, "v5p": 1.6e10, "v6e": 3.2e10}  # PCIe per chip, book
_PASSES = {"default": 1, "high": 3, "highest": 6}
_REPLAYED_ITERATIONS = 3


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of a chip's peaks: ``matmul`` of its bf16 FLOP/s, ``memory`` of
    its HBM bandwidth, ``collective`` of its ICI links' bandwidth."""
    matmul: float = 1.0
    memory: float = 1.0
    collective: float = 1.0
    source: str = "the published peaks"


# Fitted on the calibration runs (measured TPU step times published by torchprime and
# MaxText), by ``python -m benchmarks.tpu_calibration``; its results table gives each
# run's estimate, measurement and error.
CALIBRATED = Efficiency(matmul=1.0, memory=1.0, collective=1.0,
                        source="uncalibrated: the published peaks")


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


_SUMMED = ("seconds", "busy_seconds", "matmul_seconds", "memory_seconds",
           "collective_seconds", "exposed_collective_seconds", "host_transfer_seconds",
           "exposed_host_seconds", "dot_flops", "mxu_flops", "multipass_flops", "hbm_bytes",
           "kernels_without_cost")


def estimate(optimized_hlo: str, topology: Topology, efficiency: Efficiency = CALIBRATED,
             coords: Optional[Sequence[Sequence[int]]] = None) -> StepTime:
    """The step time of ``optimized_hlo`` (libtpu's scheduled module, one program) on
    ``topology``. ``coords[i]``: the grid position of the chip that runs replica (or
    partition) ``i``; by default chips are numbered with the first grid axis fastest."""
    computations, entry = parse_module(optimized_hlo)
    if entry is None:
        return StepTime(efficiency=efficiency)
    replay = _Replay(computations, topology, efficiency, coords)
    total = replay.run(entry)
    total.seconds = replay.clock
    total.efficiency = efficiency
    return total


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
             "all-reduce": 2 * result_bytes, "all-to-all": result_bytes / 4,
             "ragged-all-to-all": result_bytes / 4, "collective-broadcast": result_bytes}
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


# -- shapes -----------------------------------------------------------------------------------
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1,
                "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+(?:fn)?)?)\[([0-9,]*)\](\{[^}]*\})?")
_HOST_SPACE = 5


def _arrays(shape: str) -> Iterable[Tuple[str, List[int], int]]:
    """(dtype, dims, memory space) of every array in an HLO shape."""
    for dtype, dims, layout in _ARRAY.findall(re.sub(r"/\*.*?\*/", "", shape)):
        space = re.search(r"S\((\d+)\)", layout or "")
        yield dtype, [int(d) for d in dims.split(",") if d], int(space.group(1)) if space else 0


def _bytes(shape: str, spaces: Tuple[int, ...] = (0,)) -> float:
    """Bytes of the arrays of ``shape`` held in the memory ``spaces`` (0: HBM)."""
    return sum(math.prod(dims) * _DTYPE_BYTES.get(dtype, 4)
               for dtype, dims, space in _arrays(shape) if space in spaces)


def _dims(shape: str) -> List[int]:
    found = list(_arrays(shape))
    return found[0][1] if found else []


# -- what one instruction costs ---------------------------------------------------------------
@dataclass
class _Work:
    dot_flops: float = 0.0
    mxu_flops: float = 0.0
    multipass_flops: float = 0.0
    hbm_bytes: float = 0.0
    unknown_kernels: int = 0


_SLICING = ("dynamic-slice", "slice", "gather")
_FREE = frozenset(("parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                   "after-all", "opt-barrier", "add-dependency", "partition-id", "replica-id",
                   "copy-start", "copy-done", "send", "send-done", "recv", "recv-done",
                   "async-start", "async-update", "async-done")
                  + tuple(COLLECTIVE_OPS)
                  + tuple(op + "-start" for op in COLLECTIVE_OPS)
                  + tuple(op + "-done" for op in COLLECTIVE_OPS))


class _Costs:
    """The matmul FLOPs and HBM bytes of top-level instructions (fusions included)."""

    def __init__(self, computations: Dict[str, List[Instruction]]) -> None:
        self.computations = computations
        self._flops: Dict[str, Tuple[float, float, float]] = {}
        self._shapes: Dict[str, Dict[str, str]] = {}

    def shapes(self, computation: str) -> Dict[str, str]:
        if computation not in self._shapes:
            self._shapes[computation] = {i.name: i.shape
                                         for i in self.computations.get(computation, [])}
        return self._shapes[computation]

    def of(self, ins: Instruction, computation: str) -> _Work:
        if ins.opcode in _FREE:
            return _Work()
        shapes = self.shapes(computation)
        if ins.opcode == "custom-call" and "tpu_custom_call" in ins.text:
            return self._kernel(ins, shapes)
        work = _Work()
        if ins.opcode in ("dot", "convolution"):
            work.dot_flops, work.mxu_flops, work.multipass_flops = _dot_flops(ins, shapes)
            work.hbm_bytes = self._plain_bytes(ins, shapes)
        elif ins.opcode == "fusion":
            for callee in ins.callees:
                d, m, p = self._fused_flops(callee)
                work.dot_flops += d
                work.mxu_flops += m
                work.multipass_flops += p
            work.hbm_bytes = self._fusion_bytes(ins, shapes)
        elif ins.opcode in ("dynamic-update-slice",):
            update = shapes.get(ins.operands[1], "") if len(ins.operands) > 1 else ""
            work.hbm_bytes = 2 * _bytes(update)
        else:
            work.hbm_bytes = self._plain_bytes(ins, shapes)
        return work

    def _plain_bytes(self, ins: Instruction, shapes: Dict[str, str]) -> float:
        return _bytes(ins.shape) + sum(_bytes(shapes.get(o, "")) for o in ins.operands)

    def _kernel(self, ins: Instruction, shapes: Dict[str, str]) -> _Work:
        """A Pallas kernel: the cost estimate its lowering attached, if any."""
        work = _Work(hbm_bytes=self._plain_bytes(ins, shapes))
        config = re.search(r"backend_config=(\"(?:[^\"\\]|\\.)*\"|\{.*\})", ins.text)
        estimate_ = None
        if config:
            text = config.group(1)
            try:
                data = json.loads(json.loads(text) if text.startswith('"') else text)
                estimate_ = (data.get("custom_call_config", {}) or {}).get("cost_estimate") \
                    or data.get("cost_estimate")
            except (ValueError, AttributeError, TypeError):
                estimate_ = None
        if estimate_:
            work.dot_flops = work.mxu_flops = float(estimate_.get("flops", 0))
            work.hbm_bytes = float(estimate_.get("bytes_accessed", work.hbm_bytes))
        else:
            work.unknown_kernels = 1
        return work

    def _fused_flops(self, computation: str) -> Tuple[float, float, float]:
        if computation in self._flops:
            return self._flops[computation]
        self._flops[computation] = (0.0, 0.0, 0.0)
        dot = mxu = multipass = 0.0
        shapes = self.shapes(computation)
        for ins in self.computations.get(computation, []):
            if ins.opcode in ("dot", "convolution"):
                d, m, p = _dot_flops(ins, shapes)
            elif ins.opcode in ("fusion", "call"):
                d = m = p = 0.0
                for callee in ins.callees:
                    cd, cm, cp = self._fused_flops(callee)
                    d, m, p = d + cd, m + cm, p + cp
            else:
                continue
            dot, mxu, multipass = dot + d, mxu + m, multipass + p
        self._flops[computation] = (dot, mxu, multipass)
        return self._flops[computation]

    def _fusion_bytes(self, ins: Instruction, shapes: Dict[str, str]) -> float:
        """HBM bytes of a fusion: each operand in HBM, or only what the fused computation
        slices out of it; its results in HBM, or only the update of a result it writes in
        place (a dynamic-update-slice into an operand)."""
        callee = ins.callees[0] if ins.callees else ""
        body = self.computations.get(callee, [])
        inner = self.shapes(callee)
        params: Dict[int, Instruction] = {}
        users: Dict[str, List[Instruction]] = {}
        for i in body:
            if i.opcode == "parameter":
                m = re.match(r"parameter\((\d+)\)", i.text)
                if m:
                    params[int(m.group(1))] = i
            for o in i.operands:
                users.setdefault(o, []).append(i)
        total = 0.0
        in_place = set()
        for number, operand in enumerate(ins.operands):
            outer = shapes.get(operand, "")
            if not _bytes(outer):
                continue
            param = params.get(number)
            used = users.get(param.name, []) if param is not None else []
            if used and all(u.opcode in _SLICING and u.operands[0] == param.name for u in used):
                total += sum(_bytes(u.shape, (0, _any_space(outer))) for u in used)
            elif used and all(u.opcode == "dynamic-update-slice" and u.operands[0] == param.name
                              for u in used):
                in_place.add(number)
                total += sum(_bytes(inner.get(u.operands[1], ""), (0, 1, 2, 3, 4, 6))
                             for u in used)
            else:
                total += _bytes(outer)
        if in_place:
            return total  # the in-place result is counted as its update
        return total + _bytes(ins.shape)


def _any_space(shape: str) -> int:
    for _, _, space in _arrays(shape):
        return space
    return 0


def _passes(ins: Instruction, shapes: Dict[str, str]) -> int:
    """bf16 passes a dot runs on the MXU: 1 unless a float32 operand asks for more."""
    precision = re.search(r"operand_precision=\{([a-z]+)", ins.text)
    algorithm = re.search(r"algorithm=dot_[a-z0-9_]*_x(\d+)", ins.text)
    if algorithm:
        return int(algorithm.group(1))
    if precision is None:
        return 1
    operands = [shapes.get(o, "") for o in ins.operands[:2]]
    if not any(list(_arrays(s))[:1] and list(_arrays(s))[0][0] == "f32" for s in operands):
        return 1
    return _PASSES.get(precision.group(1), 1)


def _dot_flops(ins: Instruction, shapes: Dict[str, str]) -> Tuple[float, float, float]:
    """(FLOPs, FLOPs with every pass, FLOPs run in several passes) of a dot or convolution."""
    out = math.prod(_dims(ins.shape)) if _dims(ins.shape) else 1
    if ins.opcode == "dot":
        lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else []
        contracting = [int(d) for d in re.findall(r"\d+", ins.attr("lhs_contracting_dims") or "")]
        k = math.prod(lhs[d] for d in contracting if d < len(lhs)) if lhs else 1
        flops = 2.0 * out * k
    else:
        flops = 2.0 * out * _convolution_macs_per_output(ins, shapes)
    passes = _passes(ins, shapes)
    return flops, flops * passes, flops if passes > 1 else 0.0


def _convolution_macs_per_output(ins: Instruction, shapes: Dict[str, str]) -> float:
    """Multiply-adds per output element: the kernel's input features times the window
    positions that land on real input elements (not padding, not dilation holes)."""
    labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", ins.text)
    if not labels or len(ins.operands) < 2:
        return 1.0
    lhs_l, rhs_l, out_l = labels.groups()
    lhs = _dims(shapes.get(ins.operands[0], ""))
    rhs = _dims(shapes.get(ins.operands[1], ""))
    out = _dims(ins.shape)
    if len(rhs) != len(rhs_l) or len(lhs) != len(lhs_l) or len(out) != len(out_l):
        return 1.0
    macs = float(rhs[rhs_l.index("i")])
    window = _window(ins.attr("window") or "")
    spatial = sorted(c for c in rhs_l if c.isdigit())
    for n, dim in enumerate(spatial):
        k = rhs[rhs_l.index(dim)]
        size_in = lhs[lhs_l.index(dim)]
        size_out = out[out_l.index(dim)]
        get = lambda key, default: window.get(key, [default] * len(spatial))[n]  # noqa: E731
        pad_lo = get("pad_lo", 0)
        valid = _valid_window_positions(size_in, k, size_out, get("stride", 1), pad_lo,
                                        get("lhs_dilate", 1), get("rhs_dilate", 1))
        macs *= valid / max(size_out, 1)
    return macs


def _window(text: str) -> Dict[str, List[int]]:
    out: Dict[str, List[int]] = {}
    for key, value in re.findall(r"(\w+)=([0-9x_\-]+)", text):
        if key == "pad":
            pairs = [p.split("_") for p in value.split("x")]
            out["pad_lo"] = [int(p[0]) for p in pairs]
        else:
            out[key] = [int(v) for v in value.split("x")]
    return out


def _valid_window_positions(size_in: int, k: int, size_out: int, stride: int, pad_lo: int,
                            lhs_dilate: int, rhs_dilate: int) -> float:
    """Pairs (output position, kernel position) reading a real input element."""
    extent = (size_in - 1) * lhs_dilate + 1
    if size_out * k > 2_000_000:   # large windows: the density of real elements
        return size_out * k * min(1.0, size_in / max(extent, 1))
    count = 0
    for o in range(size_out):
        base = o * stride - pad_lo
        for j in range(k):
            pos = base + j * rhs_dilate
            if 0 <= pos < extent and pos % lhs_dilate == 0:
                count += 1
    return float(count)


# -- the replay -------------------------------------------------------------------------------
class _Replay:
    """Walks the schedule on the TensorCore's clock (see [Note: the step-time model])."""

    def __init__(self, computations: Dict[str, List[Instruction]], topology: Topology,
                 efficiency: Efficiency, coords: Optional[Sequence[Sequence[int]]]) -> None:
        self.computations = computations
        self.topology = topology
        self.efficiency = efficiency
        self.coords = [tuple(c) for c in coords] if coords else None
        self.costs = _Costs(computations)
        self.memo: Dict[str, Tuple[List[Instruction], bool]] = {}
        self.clock = 0.0
        self.ici_free = 0.0
        self.host_free = 0.0
        chip = topology.chip
        self.matmul_rate = chip.peak_bf16_flops * efficiency.matmul
        self.memory_rate = chip.hbm_bytes_per_s * efficiency.memory
        self.host_rate = HOST_LINK_BYTES_PER_S.get(chip.generation, 1.6e10)
        self._scheduled: Dict[str, List[Scheduled]] = {}

    def _coords(self, index: int) -> Tuple[int, ...]:
        if self.coords is not None and index < len(self.coords):
            return self.coords[index]
        return self.topology.coords(index)

    def _rank_group(self, piece: Instruction) -> List[Tuple[int, ...]]:
        rank_groups = piece.replica_groups
        members = rank_groups[0] if rank_groups else range(self.topology.chips)
        return [self._coords(i) for i in members]

    def run(self, computation: str) -> StepTime:
        """Replays ``computation`` from the current clock; returns what it added."""
        steps = self.computations.get(computation, [])
        if computation not in self._scheduled:
            self._scheduled[computation] = scheduled_collectives(self.computations,
                                                                 computation, self.memo)
        starts: Dict[int, List[Scheduled]] = {}
        ends: Dict[int, List[Scheduled]] = {}
        for c in self._scheduled[computation]:
            starts.setdefault(c.first, []).append(c)
            ends.setdefault(c.last, []).append(c)
        added = StepTime()
        finishes: Dict[str, float] = {}
        host: Dict[str, float] = {}
        for i, ins in enumerate(steps):
            for c in starts.get(i, []):
                opcode, result = moved_bytes(c.piece)
                seconds = collective_seconds(opcode, result, self._rank_group(c.piece),
                                             self.topology, self.efficiency)
                begin = max(self.clock, self.ici_free)
                self.ici_free = begin + seconds
                finishes[c.key] = self.ici_free
                added.collective_seconds += seconds
            if ins.opcode == "copy-start" and self._to_or_from_host(ins, computation):
                seconds = _bytes(ins.shape, (_HOST_SPACE,)) / self.host_rate
                begin = max(self.clock, self.host_free)
                self.host_free = begin + seconds
                host[ins.name] = self.host_free
                added.host_transfer_seconds += seconds
            elif ins.opcode == "copy-done" and ins.operands and ins.operands[0] in host:
                wait = max(0.0, host[ins.operands[0]] - self.clock)
                self.clock += wait
                added.exposed_host_seconds += wait
            if ins.opcode == "while":
                added.add(self._loop(ins))
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

    def _to_or_from_host(self, ins: Instruction, computation: str) -> bool:
        operand = self.costs.shapes(computation).get(ins.operands[0], "") \
            if ins.operands else ""
        return bool(_bytes(ins.shape, (_HOST_SPACE,)) or _bytes(operand, (_HOST_SPACE,)))

    def _compute(self, ins: Instruction, computation: str, added: StepTime) -> None:
        work = self.costs.of(ins, computation)
        matmul = work.mxu_flops / self.matmul_rate
        memory = work.hbm_bytes / self.memory_rate
        seconds = max(matmul, memory)
        self.clock += seconds
        added.busy_seconds += seconds
        added.matmul_seconds += matmul
        added.memory_seconds += memory
        added.dot_flops += work.dot_flops
        added.mxu_flops += work.mxu_flops
        added.multipass_flops += work.multipass_flops
        added.hbm_bytes += work.hbm_bytes
        added.kernels_without_cost += work.unknown_kernels

    def _loop(self, ins: Instruction) -> StepTime:
        body = (ins.attr("body") or "").lstrip("%")
        trips = trip_count(ins)
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


