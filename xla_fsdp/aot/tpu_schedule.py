"""What the TPU compiler did with a program's collectives, read off its optimized HLO.
Pure text analysis: no jax, no torch.

The optimized module is scheduled: each computation that runs instructions one after the
other (the entry, a while loop's body) lists them in execution order. A collective the
traced program issued may reach that schedule as one instruction (it runs synchronously,
nothing else runs meanwhile), or as a start, some steps and a done, between which other
work is scheduled. libtpu splits an asynchronous collective into fusions
(``async-collective-start``, ``async_collective_fusion`` steps, ``async-collective-done``)
whose collective ops keep the traced instruction's name in their ``op_name`` metadata; a
step fusion may also carry compute of its own (a matmul that runs while data moves).

[Note: what counts as overlapped] A collective is *asynchronous* when its pieces are
separate instructions of the schedule, and *overlapped* when compute runs between its first
and last piece, or inside one of them. Compute is any instruction that does work on data
and is not part of a collective: a fusion, convolution, dot, reduce, sort, scatter, gather
or loop, anything that makes a non-scalar value. Moves between memories
(``copy-start``/``copy-done``), views and tuple plumbing are not compute.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from .._xla.hlo_text import Instruction, array_bytes, parse_module

COLLECTIVE_OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                  "collective-permute", "collective-broadcast", "ragged-all-to-all")
# the instructions a collective is scheduled as: itself, or its start and its done
COLLECTIVE_PIECES = frozenset(op + piece for op in COLLECTIVE_OPS for piece in ("", "-start",
                                                                                "-done"))
_NOT_COMPUTE = frozenset((
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start", "copy-done",
    "copy", "replica-id", "partition-id", "after-all", "opt-barrier", "add-dependency",
    "reshape", "broadcast", "iota", "slice", "send", "send-done", "recv", "recv-done"))


def span(instruction: Instruction, participants: int) -> int:
    """How many chips one instance of the collective spans: its replica groups' size, or
    every participant when the groups are empty."""
    rank_groups = instruction.replica_groups
    return len(rank_groups[0]) if rank_groups else participants


def bytes_sent_per_chip(kind: str, result_bytes: float, size: int) -> float:
    """Bytes each chip sends for one collective under the ring algorithm: an all-gather or
    reduce-scatter moves (n-1)/n of its full-size side (an all-gather's result, n times a
    reduce-scatter's result), an all-reduce twice that; an all-to-all (n-1)/n of its
    operand; a collective permute its whole operand."""
    if size <= 1:
        return 0.0
    times = {"all-gather": 1, "reduce-scatter": size, "all-reduce": 2, "all-to-all": 1,
             "ragged-all-to-all": 1}.get(kind)
    return result_bytes if times is None else (size - 1) / size * result_bytes * times


@dataclass(frozen=True)
class Collective:
    """One collective of the program, as the TPU schedule runs it, per execution of the
    step (``count`` times per step when it sits in a loop body)."""
    kind: str                 # as the traced program issued it
    name: str                 # the traced program's instruction, or the compiler's own
    bytes_per_chip: float     # sent by each chip per step, ring algorithm
    count: int                # executions per step
    compiled_as: str          # the op(s) libtpu emitted for it
    asynchronous: bool        # start and done are separate scheduled instructions
    overlapped: bool          # compute runs between them, or inside a step
    compute_between: int      # compute instructions scheduled between start and done


def _collectives_in(computations: Dict[str, List[Instruction]], callees: Sequence[str],
                    memo: Dict[str, Tuple[List[Instruction], bool]]
                    ) -> Tuple[List[Instruction], bool]:
    """The collective ops the fused computations ``callees`` hold, and whether they hold
    compute too."""
    found, compute = [], False
    for name in callees:
        if name not in memo:
            memo[name] = ([], False)
            ops, has_compute = [], False
            for ins in computations.get(name, []):
                if ins.opcode in COLLECTIVE_PIECES:
                    if not ins.opcode.endswith("-done"):
                        ops.append(ins)
                elif ins.opcode in ("fusion", "call", "async-start"):
                    inner, inner_compute = _collectives_in(computations, ins.callees, memo)
                    ops += inner
                    has_compute = has_compute or inner_compute
                else:
                    has_compute = has_compute or _is_compute(ins)
            memo[name] = (ops, has_compute)
        found += memo[name][0]
        compute = compute or memo[name][1]
    return found, compute


def _is_compute(ins: Instruction) -> bool:
    if ins.opcode in _NOT_COMPUTE:
        return False
    return not re.fullmatch(r"[a-z0-9]+\[\](\{[^}]*\})?", ins.shape)  # not a scalar


def trip_count(ins: Instruction, computations: Dict[str, List[Instruction]],
               caller: Sequence[Instruction] = ()) -> int:
    """How many times a ``while`` runs its body: libtpu's ``known_trip_count``, else what its
    condition says (``counter < N``, the counter starting at the constant the loop's input
    tuple holds, as jax's scans are printed); 1 when neither says."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.text) or \
        re.search(r"known_trip_count=\{n=(\d+)\}", ins.text)
    if m:
        return int(m.group(1))
    condition = computations.get((ins.attr("condition") or "").lstrip("%"), [])
    root = condition[-1] if condition else None
    if root is None or root.opcode != "compare":
        return 1
    direction = root.attr("direction")
    named = {i.name: i for i in condition}
    limits = [_constant(named.get(o), named) for o in root.operands]
    if direction not in ("LT", "LE") or limits[1] is None:
        return 1
    start = 0
    by_name = {i.name: i for i in caller}
    loop_input = by_name.get(ins.operands[0]) if ins.operands else None
    if loop_input is not None and loop_input.opcode == "tuple" and loop_input.operands:
        start = _constant(by_name.get(loop_input.operands[0]), by_name) or 0
    return max(1, limits[1] - start + (direction == "LE"))


def _constant(ins: Optional[Instruction], named: Dict[str, Instruction]) -> Optional[int]:
    """The integer an instruction holds, through copies and bitcasts; None if not one."""
    while ins is not None and ins.opcode in ("copy", "bitcast", "convert") and ins.operands:
        ins = named.get(ins.operands[0])
    if ins is None or ins.opcode != "constant":
        return None
    m = re.match(r"constant\((-?\d+)\)", ins.text)
    return int(m.group(1)) if m else None


def _schedules(computations: Dict[str, List[Instruction]], entry: str
               ) -> Iterator[Tuple[str, int]]:
    """The computations that run their instructions in order (the entry, loop bodies,
    branches, called computations), each with how often it runs per step."""
    stack, seen = [(entry, 1)], set()
    while stack:
        name, times = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        yield name, times
        steps = computations.get(name, [])
        for ins in steps:
            if ins.opcode == "while":
                body = ins.attr("body")
                if body:
                    stack.append((body.lstrip("%"), times * trip_count(ins, computations,
                                                                       steps)))
            elif ins.opcode in ("conditional", "call"):
                stack.extend((c, times) for c in ins.callees)


@dataclass(frozen=True)
class Scheduled:
    """One collective in one schedule: the op that carries its shape and rank groups, and
    the positions of its first piece (it starts) and last piece (it is done) among the
    schedule's instructions; equal when it runs synchronously."""
    key: str
    piece: Instruction
    first: int
    last: int
    asynchronous: bool
    fused_compute: bool       # a step of it carries compute of its own
    compute_between: int      # compute instructions scheduled between first and last


def scheduled_collectives(computations: Dict[str, List[Instruction]], schedule: str,
                          memo: Dict[str, Tuple[List[Instruction], bool]]
                          ) -> List[Scheduled]:
    """The collectives of one schedule, in the order they start (see [Note: what counts
    as overlapped]); ``memo`` caches what fused computations hold, across calls."""
    steps = computations[schedule]
    chains: Dict[str, List[int]] = {}
    pieces: Dict[str, Instruction] = {}
    fused_compute: Dict[int, bool] = {}
    for i, ins in enumerate(steps):
        if ins.opcode in COLLECTIVE_PIECES:
            held, compute = ([ins], False)
            if ins.opcode.endswith("-done"):
                start = _start_of(steps, ins) or ins
                chains.setdefault(_chain_key(start, computations), []).append(i)
                continue
        elif ins.opcode in ("fusion", "async-start", "async-update", "async-done"):
            held, compute = _collectives_in(computations, ins.callees, memo)
        else:
            continue
        fused_compute[i] = compute
        for piece in held:
            key = _chain_key(piece, computations)
            chains.setdefault(key, []).append(i)
            pieces.setdefault(key, piece)
    members = {i for idx in chains.values() for i in idx}
    out = []
    for key, idx in sorted(chains.items(), key=lambda kv: kv[1][0]):
        if key not in pieces:
            continue
        lo, hi = min(idx), max(idx)
        out.append(Scheduled(
            key, pieces[key], lo, hi, len(set(idx)) > 1,
            any(fused_compute.get(j, False) for j in idx),
            sum(1 for j in range(lo + 1, hi) if j not in members and _is_compute(steps[j]))))
    return out


def moved_bytes(piece: Instruction) -> Tuple[str, float]:
    """The op libtpu emitted for a collective and the bytes of its result."""
    return piece.opcode.replace("-start", ""), array_bytes(_result_shape(piece))


def collectives(optimized_hlo: str, participants: int,
                traced_kinds: Optional[Dict[str, str]] = None
                ) -> List[Collective]:
    """Every collective in ``optimized_hlo`` (libtpu's scheduled module), in schedule
    order. ``participants``: chips taking part (replicas times partitions).
    ``traced_kinds`` maps the traced program's collective instructions to their kind, so
    that each is reported as issued (a reduce-scatter libtpu lowers to an all-reduce is
    still a reduce-scatter; its bytes are the all-reduce's); see ``traced_collectives``."""
    computations, entry = parse_module(optimized_hlo)
    if entry is None:
        return []
    traced_kinds = traced_kinds or {}
    memo: Dict[str, Tuple[List[Instruction], bool]] = {}
    out: List[Collective] = []
    for schedule, times in _schedules(computations, entry):
        for c in scheduled_collectives(computations, schedule, memo):
            compiled, result = moved_bytes(c.piece)
            moved = bytes_sent_per_chip(compiled, result, span(c.piece, participants))
            out.append(Collective(
                kind=traced_kinds.get(c.key, compiled), name=c.key, count=times,
                bytes_per_chip=times * moved, compiled_as=compiled,
                asynchronous=c.asynchronous,
                overlapped=c.compute_between > 0 or c.fused_compute,
                compute_between=c.compute_between))
    return out


def _chain_key(piece: Instruction, computations: Dict[str, List[Instruction]]) -> str:
    """The traced instruction a collective op came from: its ``op_name``; for an op libtpu
    rewrote (a reduce-scatter as an all-reduce) the ``op_name`` its reduction's parameters
    kept; else its own name."""
    names = [piece.op_name]
    reducer = piece.attr("to_apply")
    if reducer:
        names += [ins.op_name for ins in computations.get(reducer.lstrip("%"), [])
                  if ins.opcode == "parameter"]
    for name in names:
        if name and ";" not in name and re.match(r"[a-z\-]+\.\d+$", name):
            return name
    return piece.name


def _start_of(steps: List[Instruction], done: Instruction) -> Optional[Instruction]:
    operand = re.match(r"[a-z\-]+\(%?([\w.\-]+)", done.text)
    return next((ins for ins in steps if operand and ins.name == operand.group(1)), None)


def _result_shape(piece: Instruction) -> str:
    """An async start's result is (operand, result, ...): take the result."""
    if piece.opcode.endswith("-start") and piece.shape.startswith("("):
        inner = re.findall(r"[a-z0-9]+\[[0-9,]*\]", piece.shape)
        if len(inner) >= 2:
            return inner[1]
    return piece.shape


def traced_collectives(traced_hlo: str) -> Dict[str, str]:
    """The collectives of the program as traced (before libtpu): name -> kind."""
    computations, _ = parse_module(traced_hlo)
    return {ins.name: ins.opcode for steps in computations.values() for ins in steps
            if ins.opcode in COLLECTIVE_OPS}
