"""Processes that trace training steps and never execute them (``xla_fsdp.aot``).

[Note: tracing without values] To compile a step for hardware that is not here, only the
graph matters: its operations and shapes, not the values. A process that will never execute
can therefore build a model on the meta device and give its shards, buffers and every
tensor a graph leaves behind placeholders, which hold no memory. So a plan for a model
larger than this machine's memory traces in little memory. The wrapper asks ``active()``
where it would otherwise give meta tensors values (``materialize_meta``) and puts tensors
on the device through ``to_device``, checkpoint writers refuse (``refuse_writes``), and
checkpoints read as absent (``refuse_reads``); nothing else in it changes. Only the traced
process of ``xla_fsdp.aot`` activates this, once, before the user's function runs; a training
process never does.
"""
from __future__ import annotations

import errno
from typing import List, Sequence

import torch

from .private_api import placeholder, to_cpu

_ACTIVE = False


def active() -> bool:
    """Whether this process only traces (see [Note: tracing without values])."""
    return _ACTIVE


def activate() -> None:
    global _ACTIVE
    _ACTIVE = True


def to_device(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` on ``device``; a meta tensor, in a process that only traces, becomes a
    placeholder of its shape and dtype."""
    if value.is_meta and _ACTIVE:
        return placeholder(value.shape, value.dtype)
    return value.to(device)


def scalar_to_device(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 0-d host value whose value may differ between ranks (an inf flag, a gradient
    norm), on ``device`` as one element viewed as 0-d: torch_xla bakes a 0-d 0 or 1 it
    moves into the program as a constant, and the ranks would trace different programs."""
    return to_device(value.reshape(1), device).reshape(())


def to_host(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """``tensors`` copied to the host in one transfer; in a process that only traces, meta
    tensors of their shapes and dtypes (a placeholder has no value to read)."""
    if _ACTIVE:
        return [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors]
    return to_cpu(list(tensors))


def refuse_writes(path: str) -> None:
    """Raises if this process only traces: its tensors hold no values, so a checkpoint it
    wrote would hold zeros, and could replace a real one at ``path``."""
    if _ACTIVE:
        raise RuntimeError(
            f"xla_fsdp.aot: the traced function saved a checkpoint ({path}) before its "
            f"training step repeated; nothing runs in a plan, so it would hold zeros. Save "
            f"after a few steps, or skip saving when planning")


def refuse_reads(path: str) -> None:
    """Raises FileNotFoundError if this process only traces: to a plan every checkpoint is
    absent. Values loaded into placeholders would never be used, and a script resuming a
    finished run would trace what it does once there is nothing left to train instead of
    its training step."""
    if _ACTIVE:
        raise FileNotFoundError(
            errno.ENOENT, "xla_fsdp.aot: a plan reads no checkpoint (nothing runs in it, and "
            "a resumed run would plan no training step); plan without loading one", path)
