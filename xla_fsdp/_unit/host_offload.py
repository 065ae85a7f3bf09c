"""A shard whose optimizer lives on the host (``offload_optimizer=True``): the device's copy
of it, and its gradients' trip to the host.

[Note: the optimizer on the host]
With offload, the ``nn.Parameter`` a shard group exposes (what ``parameters()`` yields and
the optimizer holds) is a host tensor: the master copy, in the dtype the parameters had
(float32 under low-precision compute). An optimizer built from ``parameters()`` as usual
then keeps its state on the host and steps there with PyTorch's CPU kernels; nothing of it
is on the device. The device holds a copy of the shard in the compute dtype, which is what
gathers read:

* the copy is refreshed when the shard's generation (optimizer steps, loads, in-place
  writes, ``.data`` assigned) moved since it was made, at the unit's next
  gather: one host-to-device transfer of compute-dtype bytes per shard and step, whoever
  changed the shard. FSDP2's CPU offload instead transfers at every all-gather (two or
  three a step); keeping the copy costs ``compute bytes / world size`` of device memory
  per parameter (2 for bf16) and saves those transfers. Writes through ``.data`` count
  too (``HostShard``);
* reduced gradients collect beside the copy (``DeviceCopy.reduced``), in the dtype they were
  reduced in (bf16 unless ``fp32_reduce_scatter``: half the bytes on the device and on the
  way, cast to the shard's dtype on the host, the same values), and go to the host when
  the backward ends (``fetch_gradients``): the pending graph runs once, as
  ``torch_xla.sync()``, and every shard's gradient comes back in one transfer, added to the
  host ``.grad``. So ``.grad`` is on the host when ``backward()`` returns, as FSDP2's is:
  clipping, logging and the optimizer read it there. Fetching at the optimizer step instead
  would save nothing on the device (the gradients wait there either way) and leave
  ``.grad`` empty between backward and step.

The step program therefore holds, per parameter and rank, the compute-dtype copy and the
reduced gradient, not the float32 shard and the optimizer's state: 4 bytes under bf16
compute where there were 16 (shard, gradient, two AdamW moments).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .._xla import trace_only


@dataclass(eq=False)
class DeviceCopy:
    """The device's copy of one offloaded shard, and its gradients not yet on the host."""

    device: torch.device
    dtype: torch.dtype                        # the compute dtype
    value: Optional[torch.Tensor] = None
    generation: Optional[tuple] = None        # the shard's generation ``value`` was made at
    reduced: Optional[torch.Tensor] = None    # reduced this backward, still on the device

    @torch.no_grad()
    def current(self, shard: torch.Tensor, generation: tuple) -> torch.Tensor:
        """The copy, made again from the host ``shard`` if it changed since. A leaf that
        requires grad as the shard does: a scanned stack takes it as an autograd input."""
        if self.value is None or self.generation != generation:
            self.value = trace_only.to_device(shard.detach().to(self.dtype), self.device)
            self.generation = generation
        if self.value.requires_grad != shard.requires_grad:
            self.value.requires_grad_(shard.requires_grad)
        return self.value

    def add_gradient(self, reduced: torch.Tensor) -> None:
        self.reduced = reduced if self.reduced is None else self.reduced + reduced

    def drop_gradient(self) -> None:
        """After a backward that raised: its reduced gradient never reaches the host."""
        self.reduced = None


class HostShard(torch.nn.Parameter):
    """An offloaded shard. Its ``.data`` is ``detach()``, which shares its version counter,
    so an in-place write through ``.data`` (``p.data.copy_(ema)``, as torch_ema's
    ``restore`` writes) moves the shard's generation as any in-place write does: torch's
    ``.data`` has a counter of its own. Assigning ``.data`` (``vector_to_parameters``) is
    counted in ``assignments``."""

    @property
    def data(self) -> torch.Tensor:
        return torch.Tensor.detach(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        torch.Tensor.data.__set__(self, value)
        self.assignments = getattr(self, "assignments", 0) + 1

    def __repr__(self) -> str:
        return "Parameter on the host (offload_optimizer) containing:\n" + repr(self.data)


def host_master(value: torch.Tensor) -> torch.Tensor:
    """The host copy of a freshly cut shard that becomes the offloaded parameter: never a
    view of the original parameter, which would keep all of it alive."""
    if value.is_meta and trace_only.active():
        return value.clone()
    return value.detach().to("cpu", copy=True)


@torch.no_grad()
def fetch_gradients(pairs: Sequence[Tuple[torch.Tensor, DeviceCopy]]) -> None:
    """At the end of a backward: each (host shard, device copy) pair's reduced gradient added
    to the shard's ``.grad`` on the host (see [Note: the optimizer on the host])."""
    pairs = [(shard, copy) for shard, copy in pairs if copy.reduced is not None]
    if not pairs:
        return
    import torch_xla
    torch_xla.sync()   # the step's graph runs once, with everything else it computes
    on_host = trace_only.to_host([copy.reduced for _, copy in pairs])
    for (shard, copy), grad in zip(pairs, on_host):
        copy.reduced = None
        grad = grad.to(shard.dtype)
        if shard.grad is None:
            shard.grad = grad
        else:
            shard.grad.add_(grad)


def split_by_place(tensors: Sequence[torch.Tensor]
                   ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(on an XLA device, on the host): offloaded shards' gradients are on the host."""
    device = [t for t in tensors if t.device.type == "xla"]
    return device, [t for t in tensors if t.device.type != "xla"]
