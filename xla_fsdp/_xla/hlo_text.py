"""HLO text as XLA prints it, read into instructions: one parser for every reader of a
module (the TPU compiler's optimized programs in ``aot``, the optimizer guard's audit of
what happened to reduced gradients). Pure text; no torch, no jax."""
from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple


_OPERAND = re.compile(r"%([\w.\-]+)(?:#(\d+))?")


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

    @functools.cached_property
    def operands(self) -> List[str]:
        """Names of the instructions this one reads, in order (its parenthesised operand
        list, not the computations its attributes name)."""
        return [name for name, _ in self.operand_elements]

    @functools.cached_property
    def operand_elements(self) -> List[Tuple[str, Optional[int]]]:
        """The operands with the tuple element each reads: ``%t#2`` (jax's printing of
        element 2 of ``t``) is ``("t", 2)``, a plain ``%x`` is ``("x", None)``.

        Cached, as ``operands`` is: graph walks read an instruction's operands once per
        path through it, and finding the closing parenthesis is a scan of the text."""
        body = self.text[len(self.opcode):]
        end = _closing_paren(body)
        return [(name, int(index) if index else None) for name, index in
                _OPERAND.findall(body, 0, end)] if end else []

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


_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1,
                "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+(?:fn)?)?)\[([0-9,]*)\](\{[^}]*\})?")


def arrays(shape: str) -> Iterator[Tuple[str, List[int], int]]:
    """(dtype, dims, memory space) of every array in an HLO shape (a tuple's, in order);
    the memory space is the layout's ``S(n)``, 0 (HBM on a TPU) when it names none."""
    for dtype, dims, layout in _ARRAY.findall(re.sub(r"/\*.*?\*/", "", shape)):
        space = re.search(r"S\((\d+)\)", layout or "")
        yield dtype, [int(d) for d in dims.split(",") if d], int(space.group(1)) if space else 0


def array_bytes(shape: str, spaces: Optional[Tuple[int, ...]] = None) -> float:
    """Bytes of the arrays of ``shape``, of those held in memory ``spaces`` if given."""
    return sum(math.prod(dims) * _DTYPE_BYTES.get(dtype, 4)
               for dtype, dims, space in arrays(shape) if spaces is None or space in spaces)


def tuple_elements(shape: str) -> List[str]:
    """The element shapes of a tuple shape (a non-tuple shape is its own one element)."""
    shape = re.sub(r"/\*.*?\*/", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                out.append(shape[start:i].strip())
        elif ch == "," and depth == 1:
            out.append(shape[start:i].strip())
            start = i + 1
    return [e for e in out if e]


def _closing_paren(text: str) -> int:
    """The index just past the parenthesis that closes the one ``text`` opens (0 if none
    does)."""
    depth = 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if depth == 0:
            return i + 1
    return 0


def _split_shape(rest: str) -> Tuple[str, str]:
    """(shape, remainder) of ``rest``, which starts with an instruction's result shape."""
    end = _closing_paren(rest) if rest.startswith("(") else 0
    if end:
        return rest[:end], rest[end:].lstrip()
    shape, _, remainder = rest.partition(" ")
    return shape, remainder


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", re.S)
_INSTRUCTION_LINE = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = ")
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\(")
_COMPUTATION = re.compile(r"^(ENTRY )?%?[\w.\-]+ \(")
_COMPUTATION_NAME = re.compile(r"^(ENTRY )?%?([\w.\-]+)\s")


def parse_module(text: str) -> Tuple[Dict[str, List[Instruction]], Optional[str]]:
    """Computations by name, each a list of instructions in order, and the entry's name.
    Several modules may be concatenated; the first entry wins. An instruction may span
    lines (jax prints a kernel's metadata over several): a line that neither starts an
    instruction, a computation nor closes one continues the instruction before it."""
    computations: Dict[str, List[Instruction]] = {}
    entry, current = None, None
    lines: List[str] = []

    def finish() -> None:
        if current is None or not lines:
            return
        m = _INSTRUCTION.match(" ".join(lines))
        lines.clear()
        if not m:
            return
        shape, remainder = _split_shape(m.group(2))
        op = _OPCODE.match(remainder)
        if op:
            computations[current].append(Instruction(m.group(1), shape, op.group(1), remainder))

    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{") and \
                _COMPUTATION.match(line):
            finish()
            m = _COMPUTATION_NAME.match(line)
            current = m.group(2)
            computations[current] = []
            if m.group(1) and entry is None:
                entry = current
        elif line.rstrip() == "}":
            finish()
            current = None
        elif _INSTRUCTION_LINE.match(line):
            finish()
            lines.append(line)
        elif lines:
            lines.append(line)
    finish()
    return computations, entry
