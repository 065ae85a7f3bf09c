"""Which tensor functions hand an XLA tensor's value to the host, and so would make torch_xla
run the graph behind it: the virtual launcher turns them into collective points, and the
traced process of ``xla_fsdp.aot`` answers them without running anything."""
from __future__ import annotations

from typing import Any

import torch

# Tensor methods and functions that hand a value to Python and so force execution.
_READS = frozenset((
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
    "__complex__", "__repr__", "__str__", "__format__", "__array__", "__reduce_ex__",
    "is_nonzero", "equal", "allclose", "to", "copy_"))
# these read a value only when they move it to the CPU
_CPU_TARGET_ONLY = frozenset(("to", "copy_"))


def reads_host_value(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether calling ``func(*args, **kwargs)`` (as a torch function mode sees it) reads
    tensor values on the host."""
    name = getattr(func, "__name__", "")
    if name not in _READS:
        return False
    return name not in _CPU_TARGET_ONLY or _targets_cpu(args, kwargs)


def _targets_cpu(args: tuple, kwargs: dict) -> bool:
    def is_cpu(x: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return x.device.type == "cpu"
        if isinstance(x, (str, torch.device)):
            return torch.device(x).type == "cpu" if _is_device_like(x) else False
        return False
    return any(is_cpu(a) for a in list(args) + list(kwargs.values()))


def _is_device_like(x: Any) -> bool:
    if isinstance(x, torch.device):
        return True
    try:
        torch.device(x)
        return True
    except (RuntimeError, TypeError):
        return False
