"""HLO text as XLA prints it, read into instructions: one parser for every reader of a
module (the TPU compiler's optimized programs in ``aot``, the optimizer guard's audit of
what happened to reduced gradients). Pure text; no torch, no jax."""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    text: str

    def attr(self, key: str) -> Optional[str]:
        # comments first: a long tuple shape prints /*index=5*/ markers
        text = re.sub(r"/\*.*?\*/", "", self.text)
        m = re.search(rf"\b{key}=(%?[\w.\-]+|\{{[^}}]*\}}|\"[^\"]*\")", text)
        return m.group(1) if m else None

    @property
    def callees(self) -> List[str]:
        return re.findall(r"\b(?:calls|body|condition|to_apply|branch_computations)="
                          r"\{?%?([\w.\-]+)", self.text) + \
            [c for listed in re.findall(r"branch_computations=\{([^}]*)\}", self.text)
             for c in re.findall(r"%?([\w.\-]+)", listed)]

    @property
    def operands(self) -> List[str]:
        """Names of the instructions this one reads, in order (its parenthesised operand
        list, not the computations its attributes name)."""
        body = self.text[len(self.opcode):]
        depth = 0
        for i, ch in enumerate(body):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return re.findall(r"%([\w.\-]+)", body[:i + 1])
        return []

    @property
    def replica_groups(self) -> Optional[List[List[int]]]:
        """A collective's groups of ranks; None for one group of every rank (``{}``).
        The iota form ``[G,S]<=[dims]T(perm)`` is the ranks 0..N-1 laid out as ``dims``,
        transposed by ``perm``, read as G groups of S."""
        m = re.search(r"replica_groups=(\{(?:[^{}]|\{[^{}]*\})*\}|\[[\d,]+\]<=\[[\d,]+\]"
                      r"(?:T\([\d,]+\))?)", self.text)
        if m is None:
            return None
        text = m.group(1)
        if text.startswith("{"):
            listed = [[int(r) for r in g.split(",") if r]
                      for g in re.findall(r"\{([\d,]*)\}", text)]
            return [g for g in listed if g] or None
        shape, dims, perm = re.match(
            r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text).groups()
        count, size = (int(x) for x in shape.split(","))
        dims_ = [int(d) for d in dims.split(",")]
        order = [int(p) for p in perm.split(",")] if perm else list(range(len(dims_)))
        strides = [math.prod(dims_[i + 1:]) for i in range(len(dims_))]
        ranks = [sum(index[k] * strides[order[k]] for k in range(len(order)))
                 for index in itertools.product(*(range(dims_[o]) for o in order))]
        return [ranks[g * size:(g + 1) * size] for g in range(count)]

    @property
    def op_name(self) -> Optional[str]:
        m = re.search(r'op_name="([^"]*)"', self.text)
        return m.group(1) if m else None


def _split_shape(rest: str) -> Tuple[str, str]:
    """(shape, remainder) of ``rest``, which starts with an instruction's result shape."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    shape, _, remainder = rest.partition(" ")
    return shape, remainder


def parse_module(text: str) -> Tuple[Dict[str, List[Instruction]], Optional[str]]:
    """Computations by name, each a list of instructions in order, and the entry's name.
    Several modules may be concatenated; the first entry wins."""
    computations: Dict[str, List[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            m = re.match(r"^(ENTRY )?%?([\w.\-]+)\s", line)
            if m:
                current = m.group(2)
                computations[current] = []
                if m.group(1) and entry is None:
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is None:
            continue
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", line)
        if not m:
            continue
        shape, remainder = _split_shape(m.group(2))
        op = re.match(r"([a-z][a-z0-9\-]*)\(", remainder)
        if op:
            computations[current].append(Instruction(m.group(1), shape, op.group(1), remainder))
    return computations, entry
