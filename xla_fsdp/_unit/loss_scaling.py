"""Loss scaling over shards: ``torch.amp.GradScaler`` deciding once for all ranks.

[Note: loss scaling over shards]
``GradScaler`` skips a step, and lowers its scale, when the gradients its optimizer holds
contain an inf or a NaN. On FSDP shards each rank looks at its own slice only: with fp16
compute one rank skipped a step that another took, their scales parted, and their next
collectives no longer matched (XLA gave up on them). Once the scaler has unscaled an
optimizer over shards, each of its inf flags becomes the maximum over every rank, before
its step or its update reads them, as PyTorch FSDP's ``ShardedGradScaler`` does. Every rank,
whatever the units' ``sharding_groups``: replicas (``replicate_across_groups``) hold the same
reduced gradients, so their flags agree anyway, and an optimizer may hold the shards of
models sharded over different ranks. A host gradient's flag (``offload_optimizer``)
goes through the device. Installed with FSDP's process-wide effects.
"""
from __future__ import annotations

from typing import Dict

import torch

from .._xla.trace_only import scalar_to_device
from .shard_group import shard_groups_of
from .unit_params import params_of


def agree_on_infs(optimizer: torch.optim.Optimizer,
                  found_inf_per_device: Dict[torch.device, torch.Tensor]) -> None:
    """Makes ``optimizer``'s inf flags every rank's maximum, if it holds FSDP shards."""
    shard_groups = shard_groups_of(optimizer)
    if not shard_groups:
        return
    params = params_of(shard_groups[0])
    for flag in found_inf_per_device.values():
        agreed = params.collectives.all_reduce_max(scalar_to_device(flag, params.device), None)
        flag.copy_(agreed.to(flag.device))
