"""Reading a run's step graph: the HLO of the graph compiled in step 2 (collectives and the
bytes they move) and XLA's compiled-program memory statistics for it, found through the
marks the training loop leaves in the run's marks directory (``mark``) before and after
step 2. No XLA needed."""
from __future__ import annotations

import json
import math
import os
import re
from typing import Dict, List

_COLLECTIVE = re.compile(
    # a tuple's shape may carry /*index=5*/ markers, the only '=' allowed before the op
    r"=\s*(?P<shape>\((?:/\*index=\d+\*/|[^=])*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
    r"(?:-start)?\(")
_ARRAY = re.compile(r"(?P<dtype>pred|[a-z]+\d+)\[(?P<dims>[0-9,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


# -- the marks of a run ----------------------------------------------------------------------
def debug_file(marks_dir: str) -> str:
    """Where torch_xla writes its debug text (``PT_XLA_DEBUG_FILE``) for the run."""
    return os.path.join(marks_dir, "debug.txt")


def mark(marks_dir: str, label: str) -> None:
    """Notes which HLO dumps and how much of the debug file exist now, as ``label``."""
    path = debug_file(marks_dir)
    state = {"dumps": sorted(os.listdir(os.path.join(marks_dir, "dump"))),
             "debug_bytes": os.path.getsize(path) if os.path.exists(path) else 0}
    with open(os.path.join(marks_dir, f"{label}.json"), "w") as f:
        json.dump(state, f)


# -- collectives --------------------------------------------------------------------------
def _array_bytes(text: str) -> int:
    total = 0
    for m in _ARRAY.finditer(text):
        dims = [int(d) for d in m.group("dims").split(",") if d]
        total += math.prod(dims) * _DTYPE_BYTES[m.group("dtype")]
    return total


def collectives_in_hlo(hlo: str, world: int) -> Dict[str, dict]:
    """Count and bytes each rank sends per collective kind, for a ring implementation:
    an all-gather or reduce-scatter moves (N-1)/N of its full-size side (the result of an
    all-gather, N times the result of a reduce-scatter), an all-reduce twice that."""
    out: Dict[str, dict] = {}
    share = (world - 1) / world
    for m in _COLLECTIVE.finditer(hlo):
        op = m.group("op")
        result = _array_bytes(m.group("shape"))
        if op == "all-gather":
            moved = share * result
        elif op == "reduce-scatter":
            moved = share * result * world
        elif op == "all-reduce":
            moved = 2 * share * result
        else:
            moved = result
        entry = out.setdefault(op, {"count": 0, "bytes": 0.0})
        entry["count"] += 1
        entry["bytes"] += moved
    return out


# -- the graph of step 2 and its memory ----------------------------------------------------
def step_graph(marks_dir: str, suffix: str = ".before_optimizations.txt") -> dict:
    """The HLO and memory statistics of the graph compiled in step 2. An SPMD program is
    read after optimizations (``suffix``): only the partitioned per-device program has the
    collectives, and XLA's memory statistics are those of that per-device program."""
    with open(os.path.join(marks_dir, "before.json")) as f:
        before = json.load(f)
    with open(os.path.join(marks_dir, "after.json")) as f:
        after = json.load(f)
    new = sorted(set(after["dumps"]) - set(before["dumps"]))
    modules = [n for n in new if n.endswith(suffix)]
    if not modules:
        raise RuntimeError("no graph was compiled in step 2")
    texts = {}
    for name in modules:
        with open(os.path.join(marks_dir, "dump", name)) as f:
            texts[name] = f.read()
    biggest = max(texts, key=lambda n: len(texts[n]))
    with open(debug_file(marks_dir), "rb") as f:
        f.seek(before["debug_bytes"])
        debug = f.read(after["debug_bytes"] - before["debug_bytes"]).decode()
    stats = memory_stats(debug)
    if len(stats) != len(modules):
        raise RuntimeError(f"{len(modules)} graphs compiled in step 2 but {len(stats)} memory "
                           f"reports found")
    return {"graphs_in_step_2": len(modules), "hlo": texts[biggest],
            "peak_bytes": max(peak_of(s) for s in stats), "memory": stats}


def memory_stats(debug: str) -> List[dict]:
    """The compiled-program memory reports (GB) in torch_xla's ``PT_XLA_DEBUG_LEVEL=2`` text."""
    return [dict(zip(("input", "output", "aliased", "temp"), map(float, m)))
            for m in re.findall(r"Graph input size: ([\d.]+) GB\n.*?Graph output size: ([\d.]+)"
                                r" GB\n.*?Aliased Input size: ([\d.]+) GB\n.*?Intermediate "
                                r"tensor size: ([\d.]+) GB", debug, re.S)]


def peak_of(stats: dict) -> float:
    """Bytes live at once in a program: arguments + outputs - aliased + temporaries."""
    return (stats["input"] + stats["output"] - stats["aliased"] + stats["temp"]) * 2**30
