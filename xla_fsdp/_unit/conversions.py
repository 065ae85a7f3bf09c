"""What torch's module conversions (``to``, ``cuda``, ``cpu``, ``half``, ``float``,
``bfloat16``, ``double``, ``type``, ``to_empty``) do to a unit's shards.

[Note: converting a wrapped model]
torch converts a module through ``Module._apply``, which replaces every parameter whose
converted value is another kind of tensor (another device) by a new ``nn.Parameter``. A
shard is held beyond its module: its shard group gathers from it, and the registry finds
the shard group from it. Replaced, the module would list a copy the unit never reads. A unit
built around it later takes the copy for a parameter of its own and shards it again, the
optimizer steps that, and the inner unit goes on gathering the shard nobody updates: the
model trains with the unit frozen, silently. torch_xla's documented recipe for nested
units does exactly this with ``offload_optimizer``: each block wrapped, then
``FSDP(net.to(device))``, whose ``.to`` moves the blocks' host shards to the device.

So a unit takes its shards out of torch's conversion and decides for them, for itself and
for every unit inside it, before anything is converted:

* a conversion that leaves a shard on its device and in its dtype is nothing to the shard,
  as it is nothing to the unwrapped model's parameter;
* moving an offloaded unit to its device leaves its shards on the host: offload keeps the
  masters there, and the device already holds the copy it computes with;
* any other device or dtype is refused, naming the unit and the parameter: the shards, the
  placeholders and the optimizer's state are laid out for one device and dtype, so a
  model is moved or cast before it is wrapped (``compute_dtype`` casts what it computes
  with), and its full values are taken elsewhere with ``full_state_dict()``.

Buffers and everything else convert as torch converts them. A refusal from a unit inside a
module that is not a unit comes after torch converted that module's children before it.

A module inside a unit (``model.module.to(torch.bfloat16)``) holds placeholders, not
parameters, so torch's conversion of it alone would convert its buffers and nothing else: the
model would go on computing with the shards as they were. Its shards are judged by the same
rule, from the placeholders it holds (``check_member_conversion``, which every module's
conversion runs first: ``process_effects``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Sequence

import torch
import torch.nn as nn

from .._sharding.names import join_name
from .module_parameters import registered_parameters
from .param_record import placeholders_in
from .shard_group import ShardGroup, shard_group_holding


def check_conversion(unit_name: str, path: str, shard_groups: Sequence[ShardGroup],
                     fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Raises ``ValueError`` if ``fn``, a conversion ``Module._apply`` would apply, changes
    a shard of the unit at ``path`` (in the unwrapped model) in a way the unit cannot follow
    (see [Note: converting a wrapped model]). ``fn`` is tried on an empty tensor like each
    shard, never on the shard."""
    for shard_group in shard_groups:
        shard = shard_group.shard
        # an offloaded unit computes on the device its copies are on, and its shards stay
        # on the host whatever moves the unit there
        offload = shard_group.offload
        device = shard.device if offload is None else torch.device(offload.device)
        probe = fn(torch.empty(0, dtype=shard.dtype, device=device))
        if probe.device == device and probe.dtype == shard.dtype:
            continue
        where = f" at '{path}'" if path else ""
        raise ValueError(
            f"FSDP unit '{unit_name}'{where}: converting the wrapped model would take "
            f"'{join_name(path, shard_group.records[0].name)}' from {shard.dtype} on {device} "
            f"to {probe.dtype} on "
            f"{probe.device}. A wrapped model's shards stay on their device and in their "
            f"dtype: move or cast the model before wrapping it (compute_dtype= sets the "
            f"dtype it computes in), and take its full values elsewhere with "
            f"full_state_dict(). Nothing in this unit was converted.")


@contextlib.contextmanager
def shards_kept_out(module: nn.Module, shard_names: List[str]) -> Iterator[None]:
    """Unregisters ``module``'s shards for the duration, then registers its parameters again
    in their order, the shards as they were and the others as they are then."""
    order = [name for name, _ in registered_parameters(module, recurse=False)]
    shards = {name: module.get_parameter(name) for name in shard_names}
    for name in shard_names:
        delattr(module, name)
    try:
        yield
    finally:
        current = dict(registered_parameters(module, recurse=False))
        for name in current:
            delattr(module, name)
        for name in order:
            value = shards[name] if name in shards else current.get(name)
            if value is not None:
                module.register_parameter(name, value)


def check_member_conversion(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]
                            ) -> None:
    """``check_conversion`` for the shards whose placeholders ``module`` holds (a module
    inside a unit), before torch converts it (see [Note: converting a wrapped model])."""
    found = (shard_group_holding(v) for v in vars(module).values() if isinstance(v, torch.Tensor))
    shard_groups = list({id(g): g for g in found if g is not None}.values())
    if shard_groups:
        check_conversion(shard_groups[0].records[0].unit_name, "", shard_groups, fn)


def placeholders_follow_requires_grad() -> None:
    """Makes every module's ``requires_grad_`` set the flag on the placeholders it and its
    submodules hold, and on the shards they make up, once per process. A module inside a
    unit holds placeholders, not parameters, so torch's ``requires_grad_`` of it (freezing
    a submodule to fine-tune the rest) changed nothing, and the frozen weights trained on,
    silently."""
    original = nn.Module.requires_grad_
    if getattr(original, "follows_placeholders", False):
        return

    def requires_grad_(self: nn.Module, requires_grad: bool = True) -> nn.Module:
        held = placeholders_in(self)
        for placeholder in held:
            placeholder.requires_grad_(requires_grad)
        # a shard all of whose parameters the module holds agrees now, so that a flag set
        # on it later (unfreezing some of model.parameters()) is the newer one; part of
        # one is left to the next forward, which refuses it
        ids = {id(t) for t in held}
        shard_groups = {id(g): g for g in map(shard_group_holding, held) if g is not None}
        for shard_group in shard_groups.values():
            if all(id(r.placeholder) in ids for r in shard_group.records):
                shard_group.shard.requires_grad_(requires_grad)
                for record in shard_group.records:
                    record.agree_requires_grad(requires_grad, shard_group.accumulating())
        return original(self, requires_grad)
    requires_grad_.follows_placeholders = True  # type: ignore[attr-defined]
    requires_grad_.__doc__ = original.__doc__
    nn.Module.requires_grad_ = requires_grad_  # type: ignore[method-assign]
