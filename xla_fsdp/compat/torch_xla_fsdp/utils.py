"""torch_xla's FSDP ``utils``: activation checkpointing of a module, the weight-reading
``nn.Linear`` patch, a bucketed reduce-scatter, and the stand-ins torch_xla's ``_debug_*``
switches use (local ops with the collectives' shapes, for measuring without them)."""
from types import MethodType
from typing import Callable, List, Optional, Union

import torch
import torch.nn as nn

from xla_fsdp.activation_checkpoint import checkpoint_module
from xla_fsdp._sharding.collectives import Collectives
from xla_fsdp._xla.patched_linear import LinearReadingWeight as XLAPatchedLinear
from xla_fsdp._xla.private_api import CollectiveBindings

__all__ = ["checkpoint_module", "dummy_all_gather", "dummy_all_reduce", "DummyReduceScatter",
           "BucketizedReduceScatter", "XLAPatchedLinear", "apply_xla_patch_to_nn_linear"]


def _world() -> tuple:
    import torch_xla.runtime as xr
    return xr.global_ordinal(), xr.world_size()


def dummy_all_gather(value: torch.Tensor, dim: int = 0,
                     groups: Optional[List[List[int]]] = None) -> torch.Tensor:
    """``value`` repeated world-size times along ``dim``: an all-gather's shape, no traffic."""
    repeats = [1] * value.dim()
    repeats[dim] = _world()[1]
    return value.repeat(repeats)


def dummy_all_reduce(reduce_type: str, inputs: Union[torch.Tensor, List[torch.Tensor]],
                     scale: float = 1.0, groups: Optional[List[List[int]]] = None
                     ) -> Union[torch.Tensor, List[torch.Tensor]]:
    """``inputs`` times ``scale`` (a list is scaled in place, as ``xm.all_reduce`` does)."""
    if isinstance(inputs, torch.Tensor):
        return inputs * scale
    return [t.mul_(scale) for t in inputs]


class DummyReduceScatter:
    """Hands each input's block of this rank to its callback, unreduced."""

    def __init__(self, shard_count: int) -> None:
        if shard_count != _world()[1]:
            raise ValueError(f"shard_count {shard_count} must be the world size {_world()[1]}")
        self.scale = 1.0

    def __call__(self, input: torch.Tensor, callback: Callable[[torch.Tensor], None]) -> None:
        rank, world = _world()
        block = input.shape[0] // world
        callback(input.narrow(0, rank * block, block))

    def flush(self) -> None:
        pass


class BucketizedReduceScatter:
    """Collects inputs until they exceed ``bucket_size_mb``, then reduce-scatters them as one
    buffer (torch_xla's coalesced form aborts with pinned layouts) and hands each result
    to its callback. ``scale`` multiplies the sums."""

    def __init__(self, bucket_size_mb: int, shard_count: int,
                 groups: Optional[List[List[int]]], pin_layout: bool) -> None:
        self.bucket_size_bytes = bucket_size_mb * 1024 * 1024
        self.scale = 1.0
        self._collectives = Collectives(shard_count, groups, pin_layout, CollectiveBindings())
        self._bucket: List[torch.Tensor] = []
        self._callbacks: List[Callable[[torch.Tensor], None]] = []
        self._bytes = 0

    def __call__(self, input: torch.Tensor, callback: Callable[[torch.Tensor], None]) -> None:
        self._bucket.append(input)
        self._callbacks.append(callback)
        self._bytes += input.numel() * input.element_size()
        if self._bytes > self.bucket_size_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._bucket:
            return
        results = self._collectives.reduce_scatter(self._bucket, self.scale)
        for callback, result in zip(self._callbacks, results):
            callback(result)
        self._bucket, self._callbacks, self._bytes = [], [], 0


def _xla_patched_nn_linear_forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return XLAPatchedLinear.apply(input, module.weight, module.bias)


def apply_xla_patch_to_nn_linear(module: nn.Module,
                                 patched_function: Callable = _xla_patched_nn_linear_forward
                                 ) -> nn.Module:
    """Gives every ``nn.Linear`` in ``module`` whose forward is still the stock one (also
    under ``checkpoint_module``) ``patched_function`` as forward; returns ``module``."""
    for m in module.modules():
        if not isinstance(m, nn.Linear):
            continue
        for attr in ("forward", "_xla_checkpointed_forward_original"):
            method = getattr(m, attr, None)
            if getattr(method, "__func__", None) is nn.Linear.forward:
                m._nn_linear_forward_original = method
                setattr(m, attr, MethodType(patched_function, m))
    return module
