"""Each sync's graph, captured as torch_xla would compile it, then dropped unrun.

In the traced process ``torch_xla.sync()`` does not compile or run anything. It lowers the
pending graph of every live tensor to HLO, marks the inputs torch_xla would donate, gives
the tensors placeholders instead (``cut_pending_graphs``), and lets the user's code go on
to trace the next step. A training loop's steps repeat: once a sync's graph is one seen
before, the graphs from that one on are the steady step, and the trace stops there. Only
a repeat that updates state it read counts (some graph of it donates an input): the
graphs that give each unit its first placeholders repeat too, but read nothing.

[Note: the graph torch_xla would compile] At a sync torch_xla compiles one program whose
outputs are the live tensors with pending graphs, ordered by their lazy tensor ids, and
donates an input buffer when the tensor it belongs to is among those outputs: that tensor
gets a new buffer, so the old one may hold an output: the input was read under the lazy
tensor id that the output's pending value replaces (its alias id). Here the outputs are
found among the Python objects (and their ``.grad`` and ``._base``), checked against
torch_xla's own list of pending tensors, put in the same order, and the same rule picks
the donations. A pending tensor that is not reachable from Python cannot be an output
here; ``Graph.untracked`` counts them, and a plan with any says so.

[Note: shardings across a cut] Under SPMD, ``mark_sharding`` on a tensor whose value is a
pending graph (a parameter created on the device, as FSDPv2 shards it) annotates that
graph; after torch_xla runs it, the tensor's buffer is sharded, and the next step's
program reads it sharded. A cut gives the tensor a placeholder, which carries no sharding,
so the next graph would read it whole. The annotation is therefore noted, per lazy tensor
id, at each cut and put on the next graph's parameter read under that id. Shardings no
code named (an optimizer state sharded like its parameter) are the partitioner's to choose,
then as now (see [Note: shardings the partitioner chooses]).
"""
from __future__ import annotations

import gc
import hashlib
import re
import warnings
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import torch

from ..._xla.private_api import (alias_id, cut_pending_graphs, graph_hlo, graph_inputs,
                                 needs_computation, pending_tensor_count, sharding_spec,
                                 view_base, xla_tensor_id)


class StepFound(BaseException):
    """Raised out of the traced function's sync once the steady step is known (a
    BaseException, so that the function's own ``except Exception`` does not stop it)."""


@dataclass
class Activity:
    """What the traced function did since the last sync that the graph cannot show: the
    backward passes it ran, the optimizer steps it took (see [Note: a training step]) and
    its forward passes' matmul FLOPs (``model_flops``)."""
    backward_passes: int = 0
    optimizer_steps: int = 0
    forward_flops: float = 0.0

    def count_backward(self) -> None:
        self.backward_passes += 1

    def count_optimizer_step(self) -> None:
        self.optimizer_steps += 1

    def count_forward_flops(self, flops: float) -> None:
        self.forward_flops += flops


@dataclass
class Graph:
    """One sync's program: HLO text with its donations in the header."""
    hlo: str
    fingerprint: str
    outputs: int
    donated: int
    untracked: int = 0           # pending tensors not reachable from Python
    activity: Activity = field(default_factory=Activity)
    parameters_updated: int = 0  # parameters whose buffers the program replaces


@dataclass
class StepGraphs:
    """The graphs of the syncs so far; ``steady`` once a step repeated."""
    device: str
    max_graphs: int = 12          # distinct graphs traced before giving up on a repeat
    graphs: List[Graph] = field(default_factory=list)
    steady: Optional[List[Graph]] = None
    syncs: int = 0
    activity: Activity = field(default_factory=Activity)   # since the last sync
    # lazy tensor id -> the SPMD sharding its pending value was annotated with, for the
    # tensors given placeholders at the last cut (see [Note: shardings across a cut])
    _shardings: Dict[int, str] = field(default_factory=dict)

    def sync(self) -> None:
        """What ``torch_xla.sync()`` does in the traced process."""
        self.syncs += 1
        graph = self._capture()
        cut_pending_graphs(self.device)
        if graph is None:
            return
        graph.activity, self.activity = self.activity, Activity()
        for start, seen in enumerate(self.graphs):
            if seen.fingerprint == graph.fingerprint:
                # a training step updates state it read; graphs that only make new
                # tensors (each unit's initial placeholders) repeat without being one
                if any(g.donated for g in self.graphs[start:]):
                    self.steady = self.graphs[start:]
                    raise StepFound()
                return
        self.graphs.append(graph)
        if len(self.graphs) >= self.max_graphs:
            raise StepFound()

    def _capture(self) -> Optional[Graph]:
        tensors = list(_live_xla_tensors())
        outputs = sorted((t for t, need in zip(tensors, needs_computation(tensors)) if need),
                         key=xla_tensor_id)
        untracked = pending_tensor_count(self.device) - len(outputs)
        if not outputs:
            return None
        replaced = {alias_id(t) for t in outputs}
        input_ids, inputs = graph_inputs(outputs)
        hlo = graph_hlo(outputs)
        _check_parameters(hlo, inputs)
        donors = [i for i, tid in enumerate(input_ids) if tid in replaced]
        read = set(input_ids)
        updated = sum(1 for t in outputs
                      if isinstance(t, torch.nn.Parameter) and alias_id(t) in read)
        hlo = with_parameter_shardings(hlo, {i: self._shardings[tid]
                                             for i, tid in enumerate(input_ids)
                                             if tid in self._shardings})
        self._shardings = {xla_tensor_id(t): spec for t in outputs
                           if (spec := sharding_spec(t))}
        body = hlo.split("\n", 1)[1]
        return Graph(with_donors(hlo, donors), hashlib.sha256(body.encode()).hexdigest(),
                     len(outputs), len(donors), untracked, parameters_updated=updated)


def _live_xla_tensors() -> Iterator[torch.Tensor]:
    """Every XLA tensor reachable from Python objects, once each: tensors the garbage
    collector tracks, their gradients (which autograd may hold in C++ only) and bases."""
    seen_objects, seen_ids = set(), set()
    with warnings.catch_warnings():  # isinstance() on some objects warns (deprecated names)
        warnings.simplefilter("ignore")
        stack = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    while stack:
        t = stack.pop()
        if t is None or id(t) in seen_objects:
            continue
        seen_objects.add(id(t))
        # AOTAutograd's fake and functional tensors (torch.compile'd code) claim the xla
        # device but hold no value of their own
        if t.device.type != "xla" or type(t).__name__ == "FakeTensor":
            continue
        try:
            lazy = xla_tensor_id(t)
        except RuntimeError:  # a wrapper AOTAutograd keeps (torch.compile): no value of its own
            continue
        if t.is_leaf:
            stack.append(t.grad)
        stack.append(view_base(t))
        if lazy not in seen_ids:
            seen_ids.add(lazy)
            yield t


_PARAMETER = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* parameter\((\d+)\)")
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
           torch.float64: "f64", torch.int64: "s64", torch.int32: "s32", torch.int8: "s8",
           torch.uint8: "u8", torch.bool: "pred", torch.int16: "s16"}


def _check_parameters(hlo: str, inputs: List[torch.Tensor]) -> None:
    """The entry's parameters are the graph's inputs in the order ``graph_inputs`` gave
    them: the donations index them by that order."""
    entry = hlo[hlo.index("\nENTRY"):]
    params = {int(n): (dtype, dims) for dtype, dims, n in _PARAMETER.findall(entry)}
    if len(params) != len(inputs):
        raise RuntimeError(f"the traced graph has {len(params)} parameters but "
                           f"{len(inputs)} inputs were found")
    for i, t in enumerate(inputs):
        dtype, dims = params[i]
        want = ",".join(str(d) for d in t.shape)
        if dims != want or _DTYPES.get(t.dtype, dtype) != dtype:
            raise RuntimeError(f"parameter {i} of the traced graph is {dtype}[{dims}] but "
                               f"its input is {t.dtype}{list(t.shape)}")


def with_parameter_shardings(hlo: str, shardings: Dict[int, str]) -> str:
    """``hlo`` with ``sharding=`` on the entry parameters numbered in ``shardings`` that
    have none (see [Note: shardings across a cut])."""
    if not shardings:
        return hlo
    head, entry = hlo.split("\nENTRY", 1)

    def annotate(m: "re.Match") -> str:
        line, number = m.group(0), int(m.group(1))
        if number not in shardings or "sharding=" in line:
            return line
        return f"{line}, sharding={shardings[number]}"
    return head + "\nENTRY" + re.sub(r"^[^\n]* parameter\((\d+)\)[^\n]*", annotate, entry,
                                     flags=re.M)


def with_donors(hlo: str, donors: List[int]) -> str:
    """``hlo`` with ``buffer_donor={...}`` in its module header, as torch_xla's compile
    would have put it."""
    if not donors:
        return hlo
    header, rest = hlo.split("\n", 1)
    name_end = header.index(",") if "," in header else len(header)
    donation = "buffer_donor={ " + ", ".join(f"({i}, {{}})" for i in donors) + " }"
    return f"{header[:name_end]}, {donation}{header[name_end:]}\n{rest}"
