"""Reading the HLO of a traced (not executed) graph, one way for every test.

``traced_hlo`` asks torch_xla for the pending graph that computes some tensors; ``parse``
turns its text into computations of instructions; the queries below answer what the tests
ask of a step graph: which collectives it issues, whether one instruction depends on another.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Set, Tuple

import torch

_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\((.*)$")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce")


@dataclass(frozen=True)
class Instruction:
    name: str
    type: str        # e.g. "f32[4,8]{1,0}" or a tuple "(f32[8]{0}, f32[4]{0})"
    opcode: str
    operands: Tuple[str, ...]   # every %name the rest of the line mentions


def traced_hlo(tensors: Iterable[torch.Tensor]) -> str:
    """The HLO text of the graph that would compute ``tensors`` (nothing is executed)."""
    import torch_xla
    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))


def parse(hlo: str) -> Dict[str, List[Instruction]]:
    """{computation name: its instructions in text order}; the entry computation is also
    under ``"ENTRY"``."""
    out: Dict[str, List[Instruction]] = {}
    current: List[Instruction] = []
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = []
            out[header[2]] = current
            if header[1]:
                out["ENTRY"] = current
            continue
        m = _INSTRUCTION.match(line)
        if m:
            current.append(Instruction(m[1], m[2], m[3], tuple(re.findall(r"%([\w.-]+)", m[4]))))
    return out


def entry(hlo: str) -> List[Instruction]:
    return parse(hlo)["ENTRY"]


def find(instructions: List[Instruction], opcode: str, type_prefix: str = ""
         ) -> List[Tuple[int, Instruction]]:
    """(position, instruction) of each ``opcode`` whose type starts with ``type_prefix``."""
    return [(i, ins) for i, ins in enumerate(instructions)
            if ins.opcode == opcode and ins.type.startswith(type_prefix)]


def ancestors(instructions: List[Instruction], name: str) -> Set[str]:
    """Names of every instruction ``name`` depends on, directly or not."""
    operands = {ins.name: ins.operands for ins in instructions}
    seen: Set[str] = set()
    stack = [name]
    while stack:
        for op in operands.get(stack.pop(), ()):
            if op not in seen:
                seen.add(op)
                stack.append(op)
    return seen


def collectives(hlo: str) -> List[str]:
    """``"<opcode> <type>"`` of every collective, in text order over all computations."""
    return [f"{ins.opcode} {ins.type}" for instructions in _distinct(parse(hlo))
            for ins in instructions if ins.opcode in COLLECTIVES]


def opcodes(hlo: str) -> Set[str]:
    return {ins.opcode for instructions in _distinct(parse(hlo)) for ins in instructions}


def some_dot_reads_a_gather(hlo: str) -> bool:
    """Whether, in some computation, a dot depends (through any chain of instructions of
    that computation) on an all-gather of that same computation."""
    for instructions in _distinct(parse(hlo)):
        fed: Set[str] = set()
        for ins in instructions:
            reads = bool(fed.intersection(ins.operands))
            if ins.opcode == "dot" and reads:
                return True
            if ins.opcode == "all-gather" or reads:
                fed.add(ins.name)
    return False


def _distinct(computations: Dict[str, List[Instruction]]) -> List[List[Instruction]]:
    """Each computation once (the entry is listed under two names)."""
    seen, out = set(), []
    for instructions in computations.values():
        if id(instructions) not in seen:
            seen.add(id(instructions))
            out.append(instructions)
    return out
