"""The switches a user of ``xla_fsdp`` has against a step that does not fit, applied to an
unchanged script in the traced process (see [Note: what would fit] in ``aot/alternatives``).

Every unit the script builds (``XlaFullyShardedDataParallel``, auto-wrapped children
included, since they are built through the same constructor) gets the options the switches
name; the innermost units' modules (those holding no other unit) are checkpointed; and the
batch the outermost unit is called with is cut to a fraction along its first dimension, as a
micro-batch of gradient accumulation would be. The process counts the units it saw, so a
script without any (torch_xla's FSDP, FSDPv2) is known to take none of these switches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch


@dataclass(frozen=True)
class Switches:
    activation_checkpointing: bool = False
    offload_optimizer: bool = False
    bf16_compute: bool = False
    batch_divisor: int = 1       # the per-chip batch divided by it, as k accumulation steps

    def __str__(self) -> str:
        said = [name for name, on in (("activation checkpointing per unit",
                                       self.activation_checkpointing),
                                      ("offload_optimizer=True", self.offload_optimizer),
                                      ("compute_dtype=torch.bfloat16", self.bf16_compute)) if on]
        if self.batch_divisor > 1:
            said.append(f"1/{self.batch_divisor} of the per-chip batch, "
                        f"{self.batch_divisor} accumulation steps")
        return ", ".join(said) or "as written"

    @property
    def any(self) -> bool:
        return self != Switches()


class NotApplicable(Exception):
    """The script's step cannot take the switch (a batch that does not divide)."""


class _Seen:
    units = 0
    depth = 0


def apply(switches: Switches) -> "type[_Seen]":
    """Installs ``switches`` on every unit built from now on in this process; returns what
    counts the units built."""
    from ...activation_checkpoint import checkpoint_module
    from ...fully_sharded import XlaFullyShardedDataParallel as Unit
    from ...scanned_layers import ScannedLayers
    from ...unit_module import UnitModule

    init, forward, scanned_init = Unit.__init__, Unit.forward, ScannedLayers.__init__

    def switched_options(kwargs: Dict[str, Any]) -> None:
        _Seen.units += 1
        if switches.bf16_compute:
            kwargs["compute_dtype"] = torch.bfloat16
        if switches.offload_optimizer:
            kwargs["offload_optimizer"] = True

    def switched_scanned_init(self: Any, layers: Any, *args: Any, **kwargs: Any) -> None:
        switched_options(kwargs)
        scanned_init(self, layers, *args, **kwargs)

    def switched_init(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        switched_options(kwargs)
        if switches.activation_checkpointing and isinstance(module, torch.nn.Module) and \
                not any(isinstance(m, UnitModule) for m in module.modules()) and \
                not hasattr(module, "_xla_checkpointed_forward_original"):
            module = checkpoint_module(module)
        init(self, module, *args, **kwargs)

    def switched_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _Seen.depth == 0 and switches.batch_divisor > 1:
            args, kwargs = _micro_batch(args, kwargs, switches.batch_divisor)
        _Seen.depth += 1
        try:
            return forward(self, *args, **kwargs)
        finally:
            _Seen.depth -= 1

    Unit.__init__, Unit.forward = switched_init, switched_forward
    ScannedLayers.__init__ = switched_scanned_init
    return _Seen


def _micro_batch(args: tuple, kwargs: Dict[str, Any], divisor: int
                 ) -> Tuple[tuple, Dict[str, Any]]:
    tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)
               and t.dim() > 0]
    if not tensors:
        raise NotApplicable("the model is called without a batch tensor")
    batch = tensors[0].shape[0]
    if batch % divisor or batch < divisor:
        raise NotApplicable(f"a per-chip batch of {batch} does not divide by {divisor}")

    def cut(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
            return t[: batch // divisor]
        return t
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
