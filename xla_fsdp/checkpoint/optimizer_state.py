"""Optimizer state in every checkpoint: what is sharded like its tensor
(``state_is_sharded``, by the step's own rule, ``_sharding.state_layout``) and THE walk that
applies it to a state dict's ``state`` (``walk_state``), for a live optimizer and a saved one
alike, with what ties an optimizer's indices to the model's shards. The per-rank and DCP
saves, the live model's gathered state (``gathered_state``), the per-rank files' named walk
(``per_rank.optimizer.named_state``) and redistribution walk with ``walk_state``; the staging
loader, which reads DCP-layout keys rather than a state dict, applies the rule to each
shard's keys (``shard_state_is_sharded``). ``sources.entries`` only renames a state dict's
entries to those keys, judging nothing."""
from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import (Any, Callable, Container, Dict, FrozenSet, Iterator, List, Mapping, Optional,
                    Sequence, Set, Tuple)

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._sharding.state_layout import StateLayout, state_layout
from .files import CheckpointError, TensorRef
from .live_model import shard_keys
from .unit_protocol import ShardedModel

# a saved optimizer param group's keys that are not its settings
GROUP_MEMBERS = ("params", "param_names")


def param_group_settings(param_group: Mapping[str, Any]) -> Dict[str, Any]:
    """A param group's settings (``lr``, ``betas``, ...): what it holds but its members."""
    return {k: v for k, v in param_group.items() if k not in GROUP_MEMBERS}


def holds_settings_of(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> bool:
    """Whether a saved param group (or its settings) was saved from ``optimizer``'s class, as
    far as its settings tell: it holds every setting ``optimizer`` has, and no setting of
    torch's optimizers that ``optimizer`` lacks (Adam's state has ``amsgrad``, which Adamax,
    whose settings are all Adam's, has not), unless this optimizer's own groups hold it too
    (Hugging Face's Trainer puts ``weight_decay`` in every group, whatever the optimizer).
    Keys of the caller's and of LR schedulers (``initial_lr``) are no optimizer's. A setting
    is a default its own param groups hold: torch's ``load_state_dict`` adds
    ``differentiable`` to the defaults of optimizers whose groups never get it (Adafactor,
    LBFGS, SparseAdam), and a group saved from the same class lacks it too."""
    held = set(optimizer.defaults).intersection(*(set(g) for g in optimizer.param_groups))
    own = set(optimizer.defaults).union(*(set(g) for g in optimizer.param_groups))
    foreign = (set(saved) & _torch_settings()) - own   # weight_decay in every group (HF's)
    return held <= set(saved) and not foreign


@functools.lru_cache(maxsize=1)
def _torch_settings() -> FrozenSet[str]:
    """Every setting of the optimizers ``torch.optim`` has, read from instances over one
    probe tensor."""
    probe = [torch.zeros(2, 2, requires_grad=True)]
    out: Set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cls in vars(torch.optim).values():
            if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) \
                    and cls is not torch.optim.Optimizer:
                with contextlib.suppress(Exception):   # one that needs more to be built
                    out |= set(cls(probe, lr=1e-3).defaults)
    return frozenset(out)


def _shape_of(value: Any) -> Optional[Tuple[int, ...]]:
    """The shape of a tensor, a ``TensorRef`` or DCP's metadata of a stored tensor; None for
    anything else."""
    if isinstance(value, TensorStorageMetadata):
        return tuple(value.size)
    if isinstance(value, (torch.Tensor, TensorRef)):
        return tuple(value.shape)
    return None


def state_is_sharded(where: str, name: str, value: Any, shape: Sequence[int]) -> bool:
    """True if optimizer state ``name`` = ``value`` is cut, saved and read as its tensor of
    ``shape`` is (its shard in a live optimizer or a per-rank file, its full parameter in a
    consolidated checkpoint), False if it is the same on every rank (a step count, any
    non-tensor), by the one rule the step guard applies too (``_sharding.state_layout``).
    ``value`` is a tensor, a ``TensorRef`` or DCP's metadata of a stored tensor.

    State of any other shape is computed over a shard's own rows and columns (Adafactor's
    factored statistics, allowed by ``allow_per_shard_statistics``): it differs between
    ranks, so a checkpoint that merges ranks can neither cut it as the tensor nor keep one
    rank's copy for all, and only per-rank files hold it: ``CheckpointError``. ``where``
    names the parameter and the file."""
    value_shape = _shape_of(value)
    layout = state_layout(name, value_shape, shape)
    if layout is StateLayout.PER_SHARD:
        raise CheckpointError(
            f"{where}: optimizer state {name!r} has shape {list(value_shape)}, neither its "
            f"tensor's {list(shape)} nor a scalar: each rank holds its own (statistics over "
            f"its shard, e.g. Adafactor's), so it cannot go into a checkpoint that merges "
            f"ranks; per-rank files (save_sharded) keep every rank's.")
    return layout is StateLayout.SHARDED


def shard_state_is_sharded(where: str, name: str,
                           stored: Sequence[Tuple[str, Any, Sequence[int]]]) -> bool:
    """``state_is_sharded`` for optimizer state ``name`` of a shard that holds several
    parameters, stored per parameter (as a checkpoint of the unwrapped model stores it):
    ``stored`` holds (key, value, the parameter's shape) of each. They are one tensor's
    state, so each is sharded like its parameter or none is; else ``CheckpointError``."""
    sharded = [state_is_sharded(f"{where}: {key}", name, value, shape)
               for key, value, shape in stored]
    if any(sharded) and not all(sharded):
        odd = stored[sharded.index(not sharded[0])][0]
        raise CheckpointError(
            f"{where}: optimizer state {odd} is laid out otherwise than {stored[0][0]}, though "
            f"both parameters share one shard: each must be shaped as its parameter, or "
            f"neither")
    return sharded[0]


@dataclass(frozen=True)
class StateValue:
    """One value of an optimizer's state, and what ``state_is_sharded`` says of it."""
    index: int      # the optimizer's index of the tensor it belongs to
    name: str       # "exp_avg", "step"
    value: Any      # a tensor, a ``TensorRef``, or any other object
    sharded: bool   # cut, saved and read as its tensor is


def walk_state(state: Mapping[int, Mapping[str, Any]], shape_of: Callable[[int], Sequence[int]],
               where: Callable[[int], str]) -> Iterator[StateValue]:
    """THE walk over optimizer state for every writer and every reader of saved optimizer
    state dicts: each value of ``state`` (an optimizer state dict's ``"state"``, index ->
    name -> value: a live optimizer's, ``live_state``, or a file's), in index order, judged
    by ``state_is_sharded`` against the shape ``shape_of(index)`` of its tensor, with
    ``where(index)`` naming it in a refusal."""
    for index in sorted(state):
        shape = shape_of(index)
        for name, value in state[index].items():
            yield StateValue(index, name, value,
                             state_is_sharded(where(index), name, value, shape))


def live_state(optimizer: torch.optim.Optimizer
               ) -> Tuple[List[torch.Tensor], Dict[int, Dict[str, Any]]]:
    """A live optimizer's tensors by index (the order ``state_dict()`` numbers them in) and
    its state by index: its own dicts, nothing copied."""
    params = [p for param_group in optimizer.param_groups for p in param_group["params"]]
    return params, {i: optimizer.state[p] for i, p in enumerate(params) if p in optimizer.state}


def saved_state_dict(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """``optimizer.state_dict()``, whose param groups every save writes (a state dict hook's or
    an override's changes to their settings included), once it numbers the tensors as torch
    does, in the order of the live ``param_groups``: each save ties an index to a shard by
    that order (``live_state``, ``optimizer_shard_keys``), so a hook or override that
    renumbers them would give one tensor's state another's name. Refused (``CheckpointError``,
    naming the optimizer) instead."""
    saved = optimizer.state_dict()
    expected, start = [], 0
    for param_group in optimizer.param_groups:
        expected.append(list(range(start, start + len(param_group["params"]))))
        start += len(param_group["params"])
    got = [list(g.get("params", ())) for g in saved.get("param_groups", ())]
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                  min(len(got), len(expected)))
        raise CheckpointError(
            f"{type(optimizer).__name__}.state_dict() numbers the tensors of its param groups "
            f"otherwise than its param_groups hold them (group {at}: "
            f"{got[at] if at < len(got) else 'missing'}, where torch numbers "
            f"{expected[at] if at < len(expected) else 'no group'}): a state dict hook or "
            f"override renumbers them, and a checkpoint would give one tensor's state "
            f"another's name. Change a group's settings in such a hook, not its 'params'")
    return saved


def optimizer_shard_keys(model: ShardedModel, optimizer: torch.optim.Optimizer) -> List[str]:
    """The model state dict key of the shard each optimizer index holds, in index order
    (``RankRecord.optimizer_param_keys``)."""
    names = shard_keys(model)  # the files' keys
    refuse_foreign_params(optimizer, names)
    return [names[id(p)] for param_group in optimizer.param_groups
            for p in param_group["params"]]


def refuse_foreign_params(optimizer: torch.optim.Optimizer, shards: Container[int]) -> None:
    """Refuses (``CheckpointError``, a ``ValueError``) an optimizer holding a tensor whose
    id is not in ``shards``."""
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            if id(p) not in shards:
                raise CheckpointError(f"the optimizer holds a parameter of shape "
                                      f"{tuple(p.shape)} that is not a shard of this model; "
                                      f"create the optimizer from model.parameters() after "
                                      f"wrapping")
