"""What happened to sharded gradients between their reduce-scatter and the optimizer step,
read off the HLO of the graph that computes them. Pure text analysis.

[Note: auditing reduced gradients]
Once FSDP has reduce-scattered a gradient, each rank holds the sum over ranks of a
different slice. Two things done to it afterwards train silently wrong, and both have
happened inside client libraries that mean well (accelerate all-reducing gradients for
data parallelism; transformers 5 letting accelerate clip sharded gradients with each
rank's own norm):

* **all-reduced again** over ranks that hold different slices: every rank gets an
  average of unrelated slices;
* **scaled by a rank-local reduction** of reduced gradients, the signature of
  ``torch.nn.utils.clip_grad_norm_`` over shards: each rank clips its slice by the norm
  of its slice alone, so the update is no longer the global one.

The audit walks each gradient's graph back from the gradient until it meets a
reduce-scatter (what lies beyond is the backward pass, where rank-local reductions are the
point). On the way:

* an ``all-reduce`` whose operand reaches a reduce-scatter without a ``reduce`` in
  between (the gradient itself, not a norm of it), over replica groups that put two
  ranks of one reduce-scatter group together, is the first mistake. An all-reduce across sharding
  groups (hybrid sharding's replicas) keeps slices apart and is fine; a scalar operand
  (torch_xla's collective token, a norm) is never a gradient.
* a ``reduce`` that reaches a reduce-scatter without passing an ``all-reduce`` is the
  second: a norm of this rank's slices that feeds the gradient. A norm that goes through
  an all-reduce first (``clip_grad_norm_`` of FSDP) is the same on every rank; the walk
  stops at every all-reduce and all-gather, whose results are.

Elementwise work (scaling by a constant, clamping, adding weight decay, casting, slicing
a flat shard into parameters) passes. So does anything computed after the step began,
anything already executed (the audit sees only the pending graph), and anything inside a
computation of its own (a scanned stack's loop, a call): the audit does not look into
them, so that what it cannot follow is never refused. A refused step must be a wrong one.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

from .hlo_text import Instruction, parse_module

# collectives whose result is the same on every rank of their group
UNIFORM = frozenset(("all-reduce", "all-gather"))
# computations of their own (scanned layers' loops, calls): not looked into, never found
OPAQUE = frozenset(("while", "conditional", "call", "custom-call", "async-start", "async-done"))
ALL_REDUCED = "all-reduced across ranks that hold different slices"
LOCAL_SCALE = "scaled by a reduction of this rank's slices alone"


@dataclass(frozen=True)
class Finding:
    output: int        # index of the gradient among the graph's outputs
    what: str          # ALL_REDUCED or LOCAL_SCALE
    instruction: str   # the all-reduce or reduce that does it


WHOLE_TENSOR = "updated by a statistic of this rank's slices alone"


def audit(hlo: str, updates: bool = False) -> List[Finding]:
    """Findings for the outputs of the entry computation of ``hlo`` (one per gradient, in
    the order they were given to the lowering; with ``updates``, one per parameter an
    optimizer step updated: see [Note: auditing an optimizer's update]); empty when nothing
    is wrong."""
    graph, outputs = _entry(hlo)
    walk = _Walk(graph, updates)
    findings = []
    for index, name in enumerate(outputs):
        found = walk.after_reduction(name)
        if found is not None:
            findings.append(Finding(index, *found))
    return findings


# [Note: auditing an optimizer's update]
# An optimizer whose update reads more of a tensor than each element (LAMB's and LARS's
# trust ratios, Adafactor's row and column means, Shampoo's and Muon's matrix products)
# computes, over FSDP shards, a statistic of each rank's slice: it trains silently
# differently from the unsharded model. The ones known by name are refused before their
# first step; every other optimizer's first step is read as its gradients are (the walk
# above), from each updated shard back to the reduce-scatters: a ``dot``, or a ``reduce``
# over more than two elements per result (stacking two tensors to take their elementwise
# maximum, as Adamax does, reduces two), reached by a reduced gradient without an
# all-reduce on the way, is such a statistic. What the walk cannot follow is never found.


class _Walk:
    def __init__(self, graph: Dict[str, Instruction], updates: bool = False) -> None:
        self.graph = graph
        self.updates = updates
        self._local: Dict[str, bool] = {}        # memo of _reaches_locally

    def _inputs(self, inst: Instruction) -> List[str]:
        """What ``inst`` reads, with an element of a tuple read as that element alone:
        optimization barriers tie gradients to the backward's other values in one tuple,
        and only the gradient's own element leads back to it."""
        if inst.opcode != "get-tuple-element" or not inst.operands:
            return inst.operands
        index = int(inst.attr("index") or 0)
        source = self.graph.get(inst.operands[0])
        while source is not None and source.opcode == "opt-barrier" and source.operands:
            source = self.graph.get(source.operands[0])
        if source is not None and source.opcode == "tuple" and index < len(source.operands):
            return [source.operands[index]]
        return inst.operands

    def after_reduction(self, output: str) -> Optional[Tuple[str, str]]:
        """(what, instruction) of the first mistake between ``output`` and the
        reduce-scatters it comes from, or None."""
        def onward(inst: Instruction) -> List[str]:
            stop = inst.opcode in ("reduce-scatter", "all-gather", "all-reduce") or \
                inst.opcode in OPAQUE
            return [] if stop else self._inputs(inst)

        for inst in _reached(self.graph, output, onward):
            if inst.opcode == "all-reduce" and self._averages_slices(inst):
                return ALL_REDUCED, inst.name
            if inst.opcode == "reduce" and any(self._reaches_locally(o) for o in inst.operands):
                if not self.updates:
                    return LOCAL_SCALE, inst.name
                if self._reduces_many(inst):
                    return WHOLE_TENSOR, inst.name
            if self.updates and inst.opcode == "dot" and \
                    any(self._reaches_locally(o) for o in inst.operands):
                return WHOLE_TENSOR, inst.name
        return None

    def _reduces_many(self, inst: Instruction) -> bool:
        """More than two elements of the operand go into each element of the result."""
        source = self.graph.get(inst.operands[0]) if inst.operands else None
        operand, result = _elements(source.shape) if source else None, _elements(inst.shape)
        return operand is not None and result is not None and operand > 2 * result

    def _averages_slices(self, inst: Instruction) -> bool:
        rank_groups = inst.replica_groups
        return any(_share_two_ranks(rank_groups, scattered) for operand in inst.operands
                   if not _is_scalar(self.graph.get(operand))
                   for scattered in self._scattered_elementwise(operand))

    def _reaches_locally(self, name: str) -> bool:
        """``name`` depends on a reduce-scatter's result by a path with no all-reduce or
        all-gather (whose results are the same on every rank; torch_xla's collective token
        makes every later collective's input depend on earlier ones')."""
        memo = self._local
        stack = [(name, False)]
        while stack:
            current, expanded = stack.pop()
            if current in memo and not expanded:
                continue
            inst = self.graph.get(current)
            if inst is None or inst.opcode in UNIFORM or inst.opcode in OPAQUE:
                memo[current] = False
            elif inst.opcode == "reduce-scatter":
                memo[current] = True
            elif expanded:
                memo[current] = any(memo.get(o, False) for o in self._inputs(inst))
            else:
                stack.append((current, True))
                stack.extend((o, False) for o in self._inputs(inst) if o not in memo)
        return memo[name]

    def _scattered_elementwise(self, name: str) -> List[Optional[List[List[int]]]]:
        """Replica groups of the reduce-scatters ``name`` reaches with neither a reduce nor
        an all-reduce on the way (None: all ranks)."""
        def onward(inst: Instruction) -> List[str]:
            stop = inst.opcode in UNIFORM or inst.opcode in OPAQUE or \
                inst.opcode in ("reduce", "reduce-scatter")
            return [] if stop else self._inputs(inst)

        return [inst.replica_groups for inst in _reached(self.graph, name, onward)
                if inst.opcode == "reduce-scatter"]


def _elements(shape: str) -> Optional[int]:
    """The element count of an array shape (``f32[8,32]{1,0}``); None for a tuple."""
    m = re.fullmatch(r"[a-z0-9]+\[([\d,]*)\](\{[\d,]*\})?", shape)
    return None if m is None else math.prod(int(d) for d in filter(None, m.group(1).split(",")))


def _entry(hlo: str) -> Tuple[Dict[str, Instruction], List[str]]:
    """The entry computation's instructions by name, and its outputs in order."""
    computations, entry = parse_module(hlo)
    if entry is None:
        return {}, []
    root = computations[entry][-1]
    return ({i.name: i for i in computations[entry]},
            root.operands if root.opcode == "tuple" else [root.name])


def all_reduced(hlo: str, count: int) -> List[bool]:
    """For each of the ``count`` outputs of ``hlo``: whether an all-reduce (or what the
    walks cannot follow) is in the graph that computes it; True for all when the HLO does
    not list them."""
    graph, outputs = _entry(hlo)
    if len(outputs) != count:
        return [True] * count
    return [any(inst.opcode == "all-reduce" or inst.opcode in OPAQUE
                for inst in _reached(graph, name, lambda inst: inst.operands))
            for name in outputs]


def _reached(graph: Dict[str, Instruction], start: str,
             onward: Callable[[Instruction], List[str]]) -> Iterator[Instruction]:
    """Every instruction of ``graph`` reached from ``start``, each once, depth first, going
    on from each to the names ``onward`` gives (after the caller has seen it)."""
    seen: Set[str] = set()
    stack = [start]
    while stack:
        name = stack.pop()
        if name in seen or name not in graph:
            continue
        seen.add(name)
        yield graph[name]
        stack.extend(onward(graph[name]))


def _is_scalar(inst: Optional[Instruction]) -> bool:
    return inst is not None and re.fullmatch(r"[a-z0-9]+\[\](\{\})?", inst.shape) is not None


def _share_two_ranks(a: Optional[List[List[int]]], b: Optional[List[List[int]]]) -> bool:
    """Some group of ``a`` and some group of ``b`` have two ranks in common (None: one
    group of every rank)."""
    if a is None or b is None:
        other = b if a is None else a
        return other is None or any(len(g) > 1 for g in other)
    return any(len(set(g) & set(h)) > 1 for g in a for h in b)
