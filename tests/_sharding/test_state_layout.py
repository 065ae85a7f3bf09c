"""The one rule for optimizer state against its tensor (``_sharding.state_layout``), which the
step guard and every checkpoint apply."""
import pytest
import torch

from xla_fsdp._sharding.state_layout import StateLayout, state_layout
from xla_fsdp.checkpoint.files import CheckpointError
from xla_fsdp.checkpoint.optimizer_state import state_is_sharded

CASES = [   # (name, value's shape or None, tensor's shape, layout)
    ("exp_avg", (8,), (8,), StateLayout.SHARDED),
    ("exp_avg", (4, 2), (4, 2), StateLayout.SHARDED),
    ("step", (), (8,), StateLayout.SCALAR),
    ("lr_scale", None, (8,), StateLayout.SCALAR),               # not a tensor
    ("step", (), (), StateLayout.SCALAR),                       # a 0-d parameter's step count
    ("exp_avg", (), (), StateLayout.SHARDED),                   # and its moment
    ("row_var", (2,), (8,), StateLayout.PER_SHARD),             # statistics over a slice
    ("momentum_buffer", (1,), (8,), StateLayout.PER_SHARD),     # one element is not a scalar
    ("momentum_buffer", (4, 4), (8,), StateLayout.PER_SHARD),   # a whole parameter's state
    ("exp_avg", (1,), (1,), StateLayout.SHARDED),
    ("step", (1,), (8,), StateLayout.SCALAR),                   # older torch's capturable step
    ("max_exp_avg_sq", (0,), (8,), StateLayout.SCALAR),         # torch_xla's syncfree Adam
]


@pytest.mark.parametrize("name,value_shape,shape,layout", CASES)
def test_state_layout(name, value_shape, shape, layout):
    assert state_layout(name, value_shape, shape) is layout


@pytest.mark.parametrize("name,value_shape,shape,layout", CASES)
def test_checkpoints_apply_the_same_rule(name, value_shape, shape, layout):
    """A checkpoint that merges ranks cuts what is sharded, keeps one copy of a scalar, and
    refuses exactly what the step refuses."""
    value = 0.5 if value_shape is None else torch.zeros(value_shape)
    if layout is StateLayout.PER_SHARD:
        with pytest.raises(CheckpointError, match="neither its tensor's"):
            state_is_sharded("w", name, value, shape)
    else:
        assert state_is_sharded("w", name, value, shape) == (layout is StateLayout.SHARDED)
