"""torch_xla's ``xla_fully_sharded_data_parallel`` module: the wrapper, its training states
and its helpers for nested containers of tensors."""
from typing import Any, Callable, List

import torch

from xla_fsdp._sharding.tensor_tree import collect_tensors as _collect
from xla_fsdp._sharding.tensor_tree import map_tensors
from xla_fsdp.fully_sharded import XlaFullyShardedDataParallel
from xla_fsdp._unit.training_state import TrainingState

__all__ = ["XlaFullyShardedDataParallel", "TrainingState", "apply_to_tensors", "collect_tensors"]


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], container: Any) -> Any:
    """``container`` with ``fn`` applied to every tensor in its lists, tuples, sets and dicts."""
    return map_tensors(fn, container)


def collect_tensors(container: Any) -> List[torch.Tensor]:
    """Every distinct tensor in ``container``, in order of first appearance."""
    return _collect(container)
