"""What every optimizer step checks and records for FSDP shards.

Installed as global optimizer step hooks (``process_effects``): before a step, refuse what
would train silently wrong (an optimizer over the parameters FSDP replaced, a step after a
``no_sync`` backward whose gradients were never reduced, ``xm.optimizer_step`` or
accelerate averaging the already-sharded gradients across ranks, and at an optimizer's
first step anything in the pending graph that all-reduces reduced gradients again or
scales them by one rank's own norm, see [Note: auditing reduced gradients]); after it, count
the update of each shard it stepped (see ``ShardGroup.generation``).
"""
from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import Any, List

import torch

from .._xla import reduced_gradients
from .._xla.private_api import graph_hlo, needs_computation
from .param_record import taken_name
from .shard_group import shard_group_of

ACCELERATE_FSDP = "ACCELERATE_USE_FSDP"


def declare_sharded_gradients() -> None:
    """Tells Hugging Face accelerate that this process trains an FSDP model.

    Without ``ACCELERATE_USE_FSDP`` accelerate all-reduces every gradient on XLA, in its
    optimizer step and its ``clip_grad_norm_``, averaging different ranks' shards together;
    transformers' Trainer sets it only for non-XLA FSDP. accelerate reads it at each step,
    so setting it when a unit is built is in time. A value the user set is kept, and
    ``check_step`` refuses the step it would corrupt."""
    value = os.environ.setdefault(ACCELERATE_FSDP, "true")
    if not _accelerate_told():
        warnings.warn(f"{ACCELERATE_FSDP}={value}: accelerate (and Hugging Face Trainer) will "
                      f"all-reduce the sharded gradients of this FSDP model, averaging different "
                      f"ranks' shards; its optimizer step will be refused")


def _accelerate_told() -> bool:
    return os.environ.get(ACCELERATE_FSDP, "").lower() in ("1", "true")


def count_updates(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step post-hook."""
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            shard_group = shard_group_of(p)
            if shard_group is not None:
                shard_group.mark_updated()


_audited: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook."""
    stale, unreduced, sharded = [], [], []
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            shard_group = shard_group_of(p)
            if shard_group is not None:
                sharded.append(p)
                if shard_group.accumulating():
                    unreduced.append(shard_group.names[0])
            elif taken_name(p) is not None:
                stale.append(taken_name(p))
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__} holds parameters that FSDP has replaced by shards "
            f"({', '.join(stale[:5])}{', ...' if len(stale) > 5 else ''}). Create the optimizer "
            f"after wrapping, from the wrapped model's parameters().")
    if unreduced:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() after a backward under no_sync() and no "
            f"synchronised backward since: the gradients of {', '.join(unreduced[:5])}"
            f"{', ...' if len(unreduced) > 5 else ''} are not reduced across ranks yet. Run "
            f"the last micro-batch's backward outside no_sync().")
    if sharded and _called_from("optimizer_step", "torch_xla/core/xla_model.py"):
        raise RuntimeError(
            "xm.optimizer_step() averages gradients across all replicas, but FSDP gradients "
            "are already reduced and each rank holds a different shard. Call "
            "optimizer.step() instead.")
    if sharded and not _accelerate_told() and _called_from("step", "accelerate/optimizer.py"):
        raise RuntimeError(
            "accelerate has just all-reduced the FSDP gradients across replicas, averaging "
            "different ranks' shards together, because ACCELERATE_USE_FSDP is not set "
            "(Hugging Face Trainer sets it only for non-XLA FSDP, and xla_fsdp sets it when a "
            "unit is built unless it is set already). Set ACCELERATE_USE_FSDP=true.")
    if sharded and optimizer not in _audited:
        _audit_reduced_gradients(optimizer, sharded)
        _audited.add(optimizer)


def _audit_reduced_gradients(optimizer: torch.optim.Optimizer,
                             params: List[torch.Tensor]) -> None:
    """See [Note: auditing reduced gradients]: once per optimizer, on the graph of the
    gradients it is about to apply, before anything of it runs."""
    # a world of one holds whole gradients: nothing done to them mixes slices
    audited = [p for p in params if p.grad is not None and p.grad.device.type == "xla"
               and shard_group_of(p).layout.world_size > 1]
    if audited:
        pending = needs_computation([p.grad for p in audited])
        audited = [p for p, waits in zip(audited, pending) if waits]
    if not audited:
        return
    findings = reduced_gradients.audit(graph_hlo([p.grad for p in audited]))
    if not findings:
        return
    names = [shard_group_of(audited[f.output]).names[0] for f in findings]
    first = findings[0]
    raise RuntimeError(
        f"{type(optimizer).__name__}.step(): the FSDP gradients of {', '.join(names[:5])}"
        f"{', ...' if len(names) > 5 else ''} were {first.what} after FSDP reduce-scattered "
        f"them (HLO instruction {first.instruction} of the pending step), so each rank would "
        f"apply a different, wrong update. The usual causes: "
        + ("torch.nn.utils.clip_grad_norm_ (or a library's clipping) over the shards instead "
           "of the FSDP model's clip_grad_norm_(), which takes the norm over all ranks"
           if first.what == reduced_gradients.LOCAL_SCALE else
           "a data-parallel gradient all-reduce (xm.reduce_gradients, xm.optimizer_step, "
           "accelerate without ACCELERATE_USE_FSDP) on a model whose FSDP units already "
           "reduce their gradients") + ". The step is refused before any update.")


def _called_from(function: str, file_suffix: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == function and code.co_filename.endswith(file_suffix):
            return True
        frame = frame.f_back
    return False
