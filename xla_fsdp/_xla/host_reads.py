"""Which tensor functions hand an XLA tensor's value to the host, and so would make torch_xla
run the graph behind it: the virtual launcher turns them into collective points, and the
traced process of ``xla_fsdp.aot`` answers them without running anything. Functions whose
result's shape depends on values (``nonzero``, indexing by a boolean mask) run the graph
too, though they hand nothing to Python: the launcher routes them as well."""
from __future__ import annotations

import re
from typing import Any, List

import torch

from .private_api import pending_ir

# a user computation (``xla::scan``, a while loop whose body may gather and reduce-scatter)
# shows as one opaque node: counted as a collective
_COLLECTIVE_IR = re.compile(
    r"xla::(cross_replica_sum|all_reduce|all_gather|reduce_scatter|all_to_all|"
    r"collective_permute|send|recv|scan)")

# Tensor methods and functions that hand a value to Python and so force execution.
_READS = frozenset((
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
    "__complex__", "__repr__", "__str__", "__format__", "__array__", "__reduce_ex__",
    "is_nonzero", "equal", "allclose", "to", "copy_", "__contains__"))
# these read a value only when they move it to the CPU (a subset of _READS)
_CPU_TARGET_ONLY = frozenset(("to", "copy_"))


# results whose shape depends on the values: torch_xla runs the graph to learn it
_SHAPE_FROM_VALUES = frozenset(("nonzero", "argwhere", "masked_select", "unique",
                                "unique_consecutive"))
# ops torch_xla 2.9 runs on the CPU (its fallbacks), which read their operands there; the
# list is ``torch_xla.debug.metrics.executed_fallback_ops()`` over a probe of torch's
# functions (nanmedian, quantile, kthvalue and argsort run on the device) and of torch.nn's
# modules (weight_norm, the orthogonal and spectral_norm parametrizations, EmbeddingBag).
# Their backward kernels run in autograd's engine, which no torch function mode sees.
_CPU_FALLBACKS = frozenset(("bincount", "histc", "median", "nanmedian", "mode",
                            "searchsorted", "isin", "multinomial", "logcumsumexp",
                            "linalg_det", "det", "_weight_norm", "matrix_exp",
                            "linalg_matrix_exp", "linalg_householder_product", "vdot",
                            "linalg_solve", "linalg_qr", "embedding_bag"))
# ...and indexing by a boolean mask, which is a nonzero
_INDEXING = frozenset(("__getitem__", "__setitem__", "index", "index_put", "index_put_"))
_MASKED_WRITES = frozenset(("__setitem__", "index_put", "index_put_"))


def runs_graph(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether calling ``func(*args, **kwargs)`` makes torch_xla execute the pending graph of
    its XLA arguments: a read of their values on the host, or a result whose shape depends
    on them (``torch.where(condition)`` alone, ``t[mask] = 0``: torch's Rprop does that)."""
    if reads_host_value(func, args, kwargs):
        return True
    name = getattr(func, "__name__", "")
    if name in _SHAPE_FROM_VALUES or name in _CPU_FALLBACKS:
        return True
    if name == "repeat_interleave":  # by a tensor of counts: a fallback, and a nonzero
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor)
    if name == "where":
        return len(args) + len(kwargs) == 1
    if func is torch.nn.functional.embedding:   # renormalises its rows on the CPU first
        return (args[3] if len(args) > 3 else kwargs.get("max_norm")) is not None
    return name in _INDEXING and len(args) > 1 and _has_mask(args[1])


def masked_write_result(func: Any, args: tuple, result: Any) -> Any:
    """The tensor that a write through a boolean mask (``t[mask] = v``, ``index_put``) made,
    or None for any other call. Its shape is static, but its pending graph holds the mask's
    nonzero indices, whose count depends on the values."""
    name = getattr(func, "__name__", "")
    if name not in _MASKED_WRITES or len(args) < 2 or not _has_mask(args[1]):
        return None
    return result if name == "index_put" else args[0]


def _has_mask(index: Any) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, (tuple, list)):
        return any(_has_mask(i) for i in index)
    return False


def reads_host_value(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether calling ``func(*args, **kwargs)`` (as a torch function mode sees it) reads
    tensor values on the host."""
    name = getattr(func, "__name__", "")
    if name in _CPU_TARGET_ONLY:
        return any(_is_cpu(a) for a in list(args) + list(kwargs.values()))
    return name in _READS


def _is_cpu(x: Any) -> bool:
    """A CPU tensor, or a CPU device (a ``torch.device`` or a string naming one)."""
    if isinstance(x, torch.Tensor):
        return x.device.type == "cpu"
    if not isinstance(x, (str, torch.device)):
        return False
    try:
        return torch.device(x).type == "cpu"
    except (RuntimeError, TypeError):
        return False


def has_pending_collective(tensors: List[Any]) -> bool:
    """Whether the pending graph of the XLA tensors among ``tensors`` holds a collective:
    what reading them would run on every rank."""
    xla = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla"]
    return bool(xla) and bool(_COLLECTIVE_IR.search(pending_ir(xla)))
