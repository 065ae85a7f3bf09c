"""What one instruction of libtpu's scheduled program costs the TensorCore: its matmul
FLOPs (with the bf16 passes their precision needs) and the bytes it moves to and from HBM.
Pure: HLO text in, numbers out. The step-time model (``step_time``) replays a schedule with
these costs; see [Note: the step-time model] for what is counted and what is not.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .._xla.hlo_text import Instruction, array_bytes, arrays, tuple_elements
from .tpu_schedule import COLLECTIVE_PIECES

_PASSES = {"default": 1, "high": 3, "highest": 6}
HOST_SPACE = 5            # the memory space of host memory in libtpu's layouts


def hbm_bytes(shape: str, spaces: Tuple[int, ...] = (0,)) -> float:
    """Bytes of the arrays of ``shape`` held in HBM (or in memory ``spaces``)."""
    return array_bytes(shape, spaces)


def _first_array(shape: str) -> Tuple[str, List[int], int]:
    """(dtype, dims, memory space) of the first array of ``shape``; ("", [], 0) if none."""
    return next(arrays(shape), ("", [], 0))


def _dims(shape: str) -> List[int]:
    return _first_array(shape)[1]


# -- what one instruction costs ---------------------------------------------------------------
@dataclass
class Work:
    dot_flops: float = 0.0
    mxu_flops: float = 0.0
    multipass_flops: float = 0.0
    hbm_bytes: float = 0.0
    kernels_without_cost: int = 0     # Pallas kernels whose FLOPs are unknown


_SLICING = ("dynamic-slice", "slice", "gather")
_FREE = frozenset(("parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                   "after-all", "opt-barrier", "add-dependency", "partition-id", "replica-id",
                   "copy-start", "copy-done", "send", "send-done", "recv", "recv-done",
                   "dynamic-slice-start", "dynamic-slice-done", "dynamic-update-slice-start",
                   "dynamic-update-slice-done", "slice-done",
                   "async-start", "async-update", "async-done")) | COLLECTIVE_PIECES


class Costs:
    """The matmul FLOPs and HBM bytes of top-level instructions (fusions included)."""

    def __init__(self, computations: Dict[str, List[Instruction]]) -> None:
        self.computations = computations
        self._flops: Dict[str, Tuple[float, float, float]] = {}
        self._work: Dict[Tuple[str, str], Work] = {}
        # per computation: its instructions' shapes by name
        self.shapes = {name: {i.name: i.shape for i in body} for name, body in computations.items()}

    def of(self, ins: Instruction, computation: str) -> Work:
        key = (computation, ins.name)
        if key not in self._work:
            self._work[key] = self._of(ins, computation)
        return self._work[key]

    def _of(self, ins: Instruction, computation: str) -> Work:
        if ins.opcode in _FREE:
            return Work()
        shapes = self.shapes.get(computation, {})
        if ins.opcode == "custom-call" and "tpu_custom_call" in ins.text:
            return self._kernel(ins, shapes)
        work = Work()
        if ins.opcode in ("dot", "convolution"):
            work.dot_flops, work.mxu_flops, work.multipass_flops = _dot_flops(ins, shapes)
            work.hbm_bytes = self._plain_bytes(ins, shapes)
        elif ins.opcode == "fusion":
            work.dot_flops, work.mxu_flops, work.multipass_flops = self._callees_flops(ins.callees)
            work.hbm_bytes = self._fusion_bytes(ins, shapes)
        elif ins.opcode == "slice-start":
            work.hbm_bytes = _async_slice_bytes(ins)
        elif ins.opcode in ("dynamic-update-slice",):
            operands = operand_shapes(ins, shapes)
            work.hbm_bytes = 2 * hbm_bytes(operands[1]) if len(operands) > 1 else 0.0
        else:
            work.hbm_bytes = self._plain_bytes(ins, shapes)
        return work

    def _plain_bytes(self, ins: Instruction, shapes: Dict[str, str]) -> float:
        return hbm_bytes(ins.shape) + sum(hbm_bytes(s) for s in operand_shapes(ins, shapes))

    def _kernel(self, ins: Instruction, shapes: Dict[str, str]) -> Work:
        """A Pallas kernel: the cost estimate its lowering attached, else, for an attention
        kernel known by name, its analytic cost (causal, see ``attention_kernel_cost``)."""
        work = Work(hbm_bytes=self._plain_bytes(ins, shapes))
        estimate_ = _attached_estimate(ins)
        if estimate_ is None:
            typed = [(dtype, dims) for shape in operand_shapes(ins, shapes)
                     for dtype, dims, _ in arrays(shape)]
            outputs = [dims for _, dims, _ in arrays(ins.shape)]
            estimate_ = attention_kernel_cost(f"{ins.name} {ins.op_name or ''}", typed,
                                              outputs, causal=True)
        if estimate_:
            work.dot_flops = work.mxu_flops = float(estimate_.get("flops", 0))
        else:
            work.kernels_without_cost = 1
        return work

    def _callees_flops(self, callees: List[str]) -> Tuple[float, float, float]:
        """The ``_dot_flops`` triples of the computations ``callees``, summed."""
        return _summed(self._fused_flops(callee) for callee in callees)

    def _fused_flops(self, computation: str) -> Tuple[float, float, float]:
        if computation not in self._flops:
            self._flops[computation] = (0.0, 0.0, 0.0)   # while it is summed
            shapes = self.shapes.get(computation, {})
            self._flops[computation] = _summed(
                _dot_flops(ins, shapes) if ins.opcode in ("dot", "convolution")
                else self._callees_flops(ins.callees)
                for ins in self.computations.get(computation, [])
                if ins.opcode in ("dot", "convolution", "fusion", "call"))
        return self._flops[computation]

    def _fusion_bytes(self, ins: Instruction, shapes: Dict[str, str]) -> float:
        """HBM bytes of a fusion: each operand in HBM, or only what the fused computation
        slices out of it; its results in HBM, or only the update of a result it writes in
        place (a dynamic-update-slice into an operand)."""
        callee = ins.callees[0] if ins.callees else ""
        body = self.computations.get(callee, [])
        inner = self.shapes.get(callee, {})
        params = {int(m.group(1)): i for i in body
                  if i.opcode == "parameter" and (m := re.match(r"parameter\((\d+)\)", i.text))}
        users: Dict[str, List[Instruction]] = {}
        for i in body:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        total = 0.0
        in_place = set()
        for number, outer in enumerate(operand_shapes(ins, shapes)):
            if not hbm_bytes(outer):
                continue
            param = params.get(number)
            used = users.get(param.name, []) if param is not None else []
            if used and all(u.opcode in _SLICING and u.operands[0] == param.name for u in used):
                total += sum(hbm_bytes(u.shape, (0, _first_array(outer)[2])) for u in used)
            elif used and all(u.opcode == "dynamic-update-slice" and u.operands[0] == param.name
                              for u in used):
                in_place.add(number)
                total += sum(hbm_bytes(inner.get(u.operands[1], ""), (0, 1, 2, 3, 4, 6))
                             for u in used)
            else:
                total += hbm_bytes(outer)
        if in_place:
            return total  # the in-place result is counted as its update
        return total + hbm_bytes(ins.shape)


def _summed(triples: Iterable[Tuple[float, float, float]]) -> Tuple[float, float, float]:
    dot = mxu = multipass = 0.0
    for d, m, p in triples:
        dot, mxu, multipass = dot + d, mxu + m, multipass + p
    return dot, mxu, multipass


def operand_shapes(ins: Instruction, shapes: Dict[str, str]) -> List[str]:
    """The shape of each operand (an element of a tuple where the operand reads one)."""
    out = []
    for name, index in ins.operand_elements:
        shape = shapes.get(name, "")
        if index is not None:
            elements = tuple_elements(shape)
            shape = elements[index] if index < len(elements) else ""
        out.append(shape)
    return out


def _attached_estimate(ins: Instruction) -> Optional[dict]:
    config = re.search(r"backend_config=(\"(?:[^\"\\]|\\.)*\"|\{.*\})", ins.text, re.S)
    if not config:
        return None
    text = config.group(1)
    try:
        data = json.loads(json.loads(text) if text.startswith('"') else text)
        return (data.get("custom_call_config", {}) or {}).get("cost_estimate") \
            or data.get("cost_estimate")
    except (ValueError, AttributeError, TypeError):
        return None


# Pallas attention kernels by name: the matmuls each runs (None: splash's dkv kernel, 5
# when fused with dq, i.e. when it makes dq's partials, else 4)
_ATTENTION_MATMULS = ((r"splash_mha_fwd", 2), (r"splash_mha_dkv", None), (r"splash_mha_dq", 3),
                      (r"flash_attention_dq_kernel", 3), (r"flash_attention_dkv_kernel", 4),
                      (r"flash_attention_kernel", 2))
_FLOATS = ("bf16", "f16", "f32", "float32", "bfloat16", "float16")


def attention_kernel_cost(name: str, operands: Sequence[Tuple[str, Sequence[int]]],
                          outputs: Sequence[Sequence[int]], causal: bool) -> Optional[dict]:
    """The FLOPs of a Pallas attention kernel (flash's or splash's, known by ``name``) from
    its operands' (dtype, dims) and its outputs' dims: 2 x M x N x K for each matmul it runs,
    half of it when causal, one exponential per score. None for another kernel. The query
    and key are its first two floating operands of rank 3 or more."""
    matmuls = next((n for pattern, n in _ATTENTION_MATMULS if re.search(pattern, name)), 0)
    tensors = [dims for dtype, dims in operands if len(dims) >= 3 and str(dtype) in _FLOATS]
    if matmuls == 0 or len(tensors) < 2:
        return None
    q, k = tensors[0], tensors[1]
    if matmuls is None:
        matmuls = 5 if any(len(o) == len(q) + 1 for o in outputs) else 4
    rows = math.prod(q[:-1])                    # batch x heads x query length
    share = 0.5 if causal else 1.0
    return {"flops": int(2 * rows * k[-2] * q[-1] * matmuls * share),
            "transcendentals": int(rows * k[-2] * share)}


def _passes(ins: Instruction, shapes: Dict[str, str]) -> int:
    """bf16 passes a dot runs on the MXU: 1 unless a float32 operand asks for more."""
    precision = re.search(r"operand_precision=\{([a-z]+)", ins.text)
    algorithm = re.search(r"algorithm=dot_[a-z0-9_]*_x(\d+)", ins.text)
    if algorithm:
        return int(algorithm.group(1))
    if precision is None:
        return 1
    if not any(_first_array(s)[0] == "f32" for s in operand_shapes(ins, shapes)[:2]):
        return 1
    return _PASSES.get(precision.group(1), 1)


def _dot_flops(ins: Instruction, shapes: Dict[str, str]) -> Tuple[float, float, float]:
    """(FLOPs, FLOPs with every pass, FLOPs run in several passes) of a dot or convolution."""
    out = math.prod(_dims(ins.shape))
    if ins.opcode == "dot":
        operands = operand_shapes(ins, shapes)
        lhs = _dims(operands[0]) if operands else []
        contracting = [int(d) for d in re.findall(r"\d+", ins.attr("lhs_contracting_dims") or "")]
        flops = 2.0 * out * math.prod(lhs[d] for d in contracting if d < len(lhs))
    else:
        flops = 2.0 * out * _convolution_macs_per_output(ins, shapes)
    passes = _passes(ins, shapes)
    return flops, flops * passes, flops if passes > 1 else 0.0


def _convolution_macs_per_output(ins: Instruction, shapes: Dict[str, str]) -> float:
    """Multiply-adds per output element: the kernel's input features times the window
    positions that land on real input elements (not padding, not dilation holes)."""
    labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", ins.text)
    operands = operand_shapes(ins, shapes)
    if not labels or len(operands) < 2:
        return 1.0
    lhs_l, rhs_l, out_l = labels.groups()
    lhs, rhs = _dims(operands[0]), _dims(operands[1])
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
        valid = _valid_window_positions(size_in, k, size_out, get("stride", 1), get("pad_lo", 0),
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
    positions = (o * stride - pad_lo + j * rhs_dilate for o in range(size_out) for j in range(k))
    return float(sum(1 for pos in positions if 0 <= pos < extent and pos % lhs_dilate == 0))


def _async_slice_bytes(ins: Instruction) -> float:
    """HBM bytes of an asynchronous slice (``slice-start``: a DMA libtpu schedules to bring
    part of an operand, often into on-chip memory, ahead of the instruction that reads it):
    the slice read out of HBM and, if its result is in HBM, written there; once, at its
    start. Its start holds ``((operand), result, context)``."""
    elements = tuple_elements(ins.shape)
    if len(elements) < 2:
        return 0.0
    sources = tuple_elements(elements[0]) or [elements[0]]
    read = array_bytes(elements[1]) if hbm_bytes(sources[0]) else 0.0
    return read + hbm_bytes(elements[1])


def host_transfer_bytes(ins: Instruction) -> float:
    """Bytes an asynchronous copy moves between HBM and host memory (0 if it is not one):
    a ``copy-start`` between the two, a ``dynamic-slice-start`` out of a host buffer, a
    ``dynamic-update-slice-start`` into one (how jax's offloading remat policies move
    activations). Their starts hold ``(operands, result, ...)``."""
    if ins.opcode not in ("copy-start", "dynamic-slice-start", "dynamic-update-slice-start"):
        return 0.0
    elements = tuple_elements(ins.shape)
    if len(elements) < 2 or not hbm_bytes(ins.shape, (HOST_SPACE,)):
        return 0.0
    if ins.opcode != "dynamic-update-slice-start":    # a copy or a slice: its result
        return array_bytes(elements[1])
    operands = tuple_elements(elements[0])     # (buffer, update, indices...)
    return array_bytes(operands[1]) if len(operands) > 1 else 0.0
