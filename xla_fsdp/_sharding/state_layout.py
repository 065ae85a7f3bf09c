"""THE rule for how one value of an optimizer's state is laid out against the tensor it
belongs to, for the step guard (``_unit.optimizer_guard``, over live shards) and every
checkpoint reader and writer (``checkpoint.optimizer_state``, over shards, full parameters
and stored tensors) alike, so that what trains is what a checkpoint can hold.

A value is one of three things:

* ``StateLayout.SHARDED``: laid out like its tensor (Adam's moments, SGD's momentum), so it
  is cut, gathered, saved and read as the tensor is;
* ``StateLayout.SCALAR``: the same on every rank, so one rank's copy stands for all: a 0-d
  tensor or any non-tensor (a step count), an empty tensor (torch_xla's syncfree Adam keeps
  ``max_exp_avg_sq`` as one without amsgrad), and a one-element tensor under a name torch's
  optimizers give their scalars (a ``(1,)`` step: older torch's capturable Adam, Sophia);
* ``StateLayout.PER_SHARD``: any other shape, another one-element ``(1,)`` included. That
  is state computed over a rank's own slice (Adafactor's factored statistics, an 8-bit
  optimizer's block scales), or a state of another world size or layout loaded into this
  one. It differs between ranks and is none of the parameter's elements: the step refuses
  a loaded one unless ``allow_per_shard_statistics`` accepted it, and a checkpoint that
  merges ranks always does.

It is the shape that tells, but for a 0-d tensor, whose every state is 0-d in a checkpoint of
the unwrapped model: then the names torch's optimizers give their scalars (``SCALAR_STATE``)
are scalars, and the rest (the moments) sharded. A shard is never 0-d.
"""
from __future__ import annotations

import enum
import math
from typing import Optional, Sequence

# the state torch's optimizers keep as one number per parameter whatever its shape: every
# optimizer's step count, NAdam's momentum product, ASGD's eta and mu
SCALAR_STATE = frozenset({"step", "mu_product", "eta", "mu"})


class StateLayout(enum.Enum):
    SHARDED = "laid out like its tensor"
    SCALAR = "a scalar"
    PER_SHARD = "neither"


def state_layout(name: str, value_shape: Optional[Sequence[int]],
                 shape: Sequence[int]) -> StateLayout:
    """How optimizer state ``name``, of shape ``value_shape`` (None: not a tensor), is laid
    out against its tensor of ``shape`` (a shard, or a full parameter)."""
    if value_shape is None:
        return StateLayout.SCALAR
    if tuple(value_shape) == tuple(shape) and not (len(shape) == 0 and name in SCALAR_STATE):
        return StateLayout.SHARDED
    elements = math.prod(value_shape)
    if len(value_shape) == 0 or elements == 0 or (elements == 1 and name in SCALAR_STATE):
        return StateLayout.SCALAR
    return StateLayout.PER_SHARD
