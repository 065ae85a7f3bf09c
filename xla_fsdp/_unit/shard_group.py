"""Shard groups: parameters sharded as one tensor.

A unit owns one or more shard groups (one per parameter, or per flattened set). A shard group
knows its layout, its shard (the ``nn.Parameter`` the optimizer sees), the records of its
original parameters, how often the shard was updated (optimizer steps and loads), and
whether a ``no_sync`` accumulation is pending on its shard's gradient. Those facts change
only through the methods here. What one backward has done with the shard group (which
gradients arrived, whether it was reduced) is the unit's reduction's (``UnitParams``).

With ``offload_optimizer`` the shard is on the host and the device holds a copy of it
(``local()``): see [Note: the optimizer on the host].

[Note: hooks on a shard's gradient]
A shard is not in the autograd graph (its placeholders are), so autograd never runs what is
registered on it. The hooks of ``register_post_accumulate_grad_hook`` on a shard (how an
optimizer steps inside backward, and what FSDP2 runs on its sharded parameters after their
reduce-scatter) run here instead: once at the end of each backward whose reduction changed
the shard's ``.grad``, after an offloaded gradient reached the host. A ``no_sync`` backward
changes no shard's gradient and runs none. ``register_hook`` on a shard stays silent, as
in FSDP2: autograd computes no gradient of the shard for it to see.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn

from .._sharding.layout import Dim0Layout, FlatLayout, InterleavedLayout, Layout, StackedLayout
from .._sharding.names import SHARD_PREFIX
from .._xla.private_api import post_accumulate_grad_hooks, version
from .._xla.trace_only import to_device
from .host_offload import DeviceCopy, HostShard, host_master
from .options import FsdpOptions
from .param_record import Member, ParamRecord, hold_placeholder, mark_taken
from .registry import WeakRegistry

_SEPARATOR = "_FSDP_SHARD_SEPARATOR_"
_BY_SHARD: "WeakRegistry[ShardGroup]" = WeakRegistry()
_BY_PLACEHOLDER: "WeakRegistry[ShardGroup]" = WeakRegistry()


@dataclass(eq=False)
class ShardGroup:
    layout: Layout
    shard: nn.Parameter
    records: List[ParamRecord]
    shard_name: str                      # where the unit registers the shard
    orig_name: str                       # torch_xla's name for it, relative to the unit
    orig_size: torch.Size                # torch_xla's size for it (the unflattened, unsharded)
    compute_dtype: torch.dtype           # dtype of the gathered full parameters
    updates: int = 0                     # optimizer steps and loads, equal on every rank
    # a gradient left by a no_sync backward stands for the full gradients still held by
    # the placeholders; if the optimizer drops it, the accumulation was abandoned
    sentinel: Optional[Tuple[torch.Tensor, int]] = None
    offload: Optional[DeviceCopy] = None  # with offload_optimizer: the device's copy
    # whether ``sentinel`` is set, as a plain flag: the path choice Dynamo traces
    # (``UnitParams.traceable``) then reads no tensor-holding field
    accumulation_pending: bool = False
    # the gradient the shard's hooks last ran for: a weak reference to it and its version
    hooked_gradient: Optional[Tuple[Any, int]] = None
    # a vocabulary table: its modules compute on the shard, which is never gathered (see
    # [Note: vocabulary-parallel tables])
    vocab_table: bool = False

    @property
    def names(self) -> List[str]:
        return [r.name for r in self.records]

    @property
    def placeholders(self) -> List[torch.Tensor]:
        return [r.placeholder for r in self.records]

    # -- where the values are ----------------------------------------------------------------
    def local(self) -> torch.Tensor:
        """The shard on the device, what gathers read: the shard itself, or with offload its
        device copy in the compute dtype, current with the host shard."""
        if self.offload is None:
            return self.shard
        return self.offload.current(self.shard, self.generation())

    def on_device(self) -> torch.Tensor:
        """The shard's own values (its dtype) on the device, for an exact gather."""
        if self.offload is None:
            return self.shard.detach()
        return self.shard.detach().to(self.offload.device)

    def add_gradient(self, reduced: torch.Tensor) -> None:
        """A reduce-scattered gradient of this backward, on the device: added to the shard's
        ``.grad``, or with offload held for the host (``host_offload.fetch_gradients``)."""
        if self.offload is not None:
            self.offload.add_gradient(reduced)
        elif self.shard.grad is None:
            self.shard.grad = reduced
        else:
            self.shard.grad = self.shard.grad + reduced

    def device_gradient(self) -> Optional[torch.Tensor]:
        """The shard's reduced gradient while it is on the device."""
        return self.shard.grad if self.offload is None else self.offload.reduced

    # -- updates ------------------------------------------------------------------------------
    def generation(self) -> Tuple[int, int, int]:
        """Changes whenever the shard's values may have: counted updates (torch_xla's
        foreach kernels do not bump version counters), an in-place write, or, offloaded,
        ``.data`` assigned (``HostShard``)."""
        return (version(self.shard), self.updates, getattr(self.shard, "assignments", 0))

    def mark_updated(self) -> None:
        self.updates += 1

    # -- gradients ---------------------------------------------------------------------------
    def trainable_records(self) -> List[int]:
        return [i for i, r in enumerate(self.records) if r.placeholder.requires_grad]

    def drop_unreduced(self) -> None:
        """After a backward that raised: drops the full gradients it left on the placeholders,
        unless they hold a ``no_sync`` accumulation, which they may then include. An
        offloaded shard's reduced gradient that never reached the host goes too: left on the
        device, the next backward would add it to a ``.grad`` that ``zero_grad()`` cleared."""
        if self.offload is not None:
            self.offload.drop_gradient()
        if self.sentinel is None:
            for r in self.records:
                r.placeholder.grad = None

    # -- no_sync accumulation -----------------------------------------------------------------
    def mark_accumulation(self) -> None:
        """After a ``no_sync`` backward that left full gradients on the placeholders: gives
        the shard a gradient the next reduction adds to, and remembers it."""
        if self.shard.grad is None:
            self.shard.grad = torch.zeros_like(self.shard)
        self.sentinel = (self.shard.grad, version(self.shard.grad))
        self.accumulation_pending = True

    def accumulating(self) -> bool:
        """Whether the shard's gradient is still the one a ``no_sync`` backward left."""
        if self.sentinel is None:
            return False
        tensor, seen = self.sentinel
        return self.shard.grad is tensor and version(tensor) == seen

    def accumulation_abandoned(self) -> bool:
        """The accumulation's gradient was dropped (``zero_grad()``) before any reduction."""
        return self.sentinel is not None and not self.accumulating()

    def end_accumulation(self) -> None:
        self.sentinel = None
        self.accumulation_pending = False

    def run_gradient_hooks(self) -> None:
        """At the end of a backward: the shard's post-accumulate-grad hooks, if its gradient
        changed since they last ran (see [Note: hooks on a shard's gradient])."""
        hooks = post_accumulate_grad_hooks(self.shard)
        grad = self.shard.grad
        if not hooks or grad is None or self.accumulation_pending:
            return
        seen = self.hooked_gradient
        if seen is not None and seen[0]() is grad and seen[1] == version(grad):
            return
        for hook in hooks:
            hook(self.shard)
        grad = self.shard.grad
        self.hooked_gradient = None if grad is None else (weakref.ref(grad), version(grad))


def shard_group_of(shard: torch.Tensor) -> Optional[ShardGroup]:
    return _BY_SHARD.get(shard)


def shard_group_holding(placeholder: torch.Tensor) -> Optional[ShardGroup]:
    """The shard group whose full value ``placeholder`` stands for, or None."""
    return _BY_PLACEHOLDER.get(placeholder)


def shard_groups_of(optimizer: torch.optim.Optimizer) -> List[ShardGroup]:
    """The shard groups whose shards ``optimizer`` steps, in its order."""
    found = (shard_group_of(p) for pg in optimizer.param_groups for p in pg["params"])
    return [g for g in found if g is not None]


def _layout(shapes: Tuple[torch.Size, ...], flatten: bool, dim0: bool, world_size: int,
            multiple: int) -> Layout:
    if flatten:
        return InterleavedLayout(shapes, world_size, multiple)
    if dim0 and math.prod(shapes[0]):  # no rows to block: a row block would hold nothing,
        return Dim0Layout(shapes[0], world_size)   # and XLA cannot gather a shard of nothing
    return FlatLayout(shapes, world_size, multiple)


@torch.no_grad()
def build_shard_group(layers: List[List[Member]], index: int, options: FsdpOptions, *,
                      stacked: bool, device: torch.device, compute_dtype: torch.dtype,
                      unit_name: str, vocab_table: bool) -> ShardGroup:
    """Shards one group of parameters and puts placeholders where they were.

    ``layers`` holds the group's members (parameter, every (module, attribute) holding it,
    every name it has): one list, or with ``stacked`` one list per layer of a scanned stack,
    whose members at the same position become one ``StackedLayout`` shard, laid out as the
    unit's ``options`` say. Only the shard is copied to ``device``; ``vocab_table`` marks it
    and makes it a row block of its own (see [Note: vocabulary-parallel tables])."""
    shapes = tuple(p.shape for p, _, _ in layers[0])
    # a table is a row block of its own whatever the unit's layout
    flatten = options.flatten_parameters and not vocab_table
    layout: Layout = _layout(shapes, flatten, options.shard_param_on_dim_0 or vocab_table,
                             options.world_size, options.shard_size_multiple)
    size = torch.Size([layout.numel]) if flatten else shapes[0]
    first = layers[0][0][2][0]
    if stacked:
        layout = StackedLayout(layout, len(layers))
        size = torch.Size((len(layers),) + tuple(size))
        first = first.split(".", 1)[1]  # its name within a layer
    orig_name = "_fsdp_wrapped_module." + (f"flat_param_{index}" if flatten else first)
    members = [m for layer in layers for m in layer]
    shard_value = layout.shard([p.detach() for p, _, _ in members], options.rank)
    offload = options.offload_optimizer
    shard = (HostShard(host_master(shard_value), requires_grad=members[0][0].requires_grad)
             if offload else nn.Parameter(to_device(shard_value, device),
                                          requires_grad=members[0][0].requires_grad))
    # the three attributes torch_xla's users and tools read on a shard
    shard._is_sharded = True
    shard._orig_size = size
    shard._orig_name = orig_name
    records = []
    for p, owners, names in members:
        mark_taken(p, names[0], unit_name)
        # see [Note: a freed placeholder is empty] in param_record
        full = torch.zeros(0, dtype=compute_dtype, device=device)
        full.requires_grad_(p.requires_grad)
        for m, attr in owners:
            delattr(m, attr)                     # no longer a registered parameter...
            object.__setattr__(m, attr, full)    # ...but a plain attribute: the placeholder
            hold_placeholder(m, attr, unit_name)
        records.append(ParamRecord(full, list(names), list(owners), unit_name))
    shard_group = ShardGroup(layout, shard, records,
                             f"{SHARD_PREFIX}.{orig_name}".replace(".", _SEPARATOR), orig_name,
                             size, compute_dtype,
                             offload=DeviceCopy(device, compute_dtype) if offload else None,
                             vocab_table=vocab_table)
    _BY_SHARD[shard] = shard_group
    for r in records:
        _BY_PLACEHOLDER[r.placeholder] = shard_group
    return shard_group
