"""The unwrapped model's checkpoint as every consolidated writer reads it (``UnwrappedState``):
its state dict entries in the unwrapped model's order, each read only when a writer asks for
it; the tied aliases; the optimizer's state by parameter name (``NamedState``); and the
``extra`` saved with it.

Two producers build one, and the writers (``writers/``) know neither:
* per-rank files (``per_rank.unwrapped``): each entry read from the runs of the rank files
  that hold its elements (the command line tool, ``consolidate_sharded_model_checkpoints``);
* a live model (``gathered_state``): each entry cut from its shard group, gathered over the
  collectives (``save_consolidated``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import (Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence,
                    Tuple, runtime_checkable)

import torch

from .formats.dcp.layout import KeyScheme, Path
from .optimizer_state import param_group_settings


@runtime_checkable
class Readable(Protocol):
    """A tensor of the checkpoint not read yet: its shape and dtype now, its values when
    ``read`` (a new tensor, on the host)."""

    @property
    def shape(self) -> Tuple[int, ...]: ...

    dtype: torch.dtype

    def read(self) -> torch.Tensor: ...


@dataclass
class NamedState:
    """The optimizer state an optimizer over the unwrapped model would have, by parameter
    name: each sharded value a ``Readable`` of the whole tensor, anything else (``step``) as
    the first rank holds it."""
    state: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # parameter -> its state
    shard: Dict[str, str] = field(default_factory=dict)  # parameter -> the shard it is saved with
    param_groups: List[Tuple[Dict[str, Any], List[str]]] = field(default_factory=list)
    # each param group as saved, and its parameters in the unwrapped model's order

    def in_read_order(self) -> Iterator[Tuple[str, str, Any]]:
        """(parameter name, state name, value), the parameters that share a shard one state
        name at a time, so that each state tensor of a shard is read in one pass (one gather,
        from a live model: ``gathered_state``), not once per parameter."""
        by_shard = itertools.groupby(self.state.items(), key=lambda item: self.shard[item[0]])
        for _, run in by_shard:
            run = list(run)
            for name in run[0][1]:
                for param, state in run:
                    yield param, name, state[name]

    def param_group_entries(self, scheme: KeyScheme) -> Iterator[Tuple[str, Path, Any]]:
        """(key, nest path, value) of each param group's settings and parameter names under
        ``scheme``'s keys: how every DCP-layout output (a DCP directory, the loader's
        entries) holds them."""
        for i, (param_group, params) in enumerate(self.param_groups):
            yield from scheme.param_group(i, params, param_group_settings(param_group))

    def as_indexed_state_dict(self, add: Callable[[torch.Tensor], Any]
                              ) -> Tuple[Dict[str, Any], List[str]]:
        """The state dict an optimizer over the unwrapped model's parameters would have, and
        its parameter names by index. Each tensor goes through ``add`` as it is read."""
        names = [n for _, params in self.param_groups for n in params]
        index = {n: i for i, n in enumerate(names)}
        state: Dict[int, Dict[str, Any]] = {index[p]: {} for p in self.state}
        for param, name, value in self.in_read_order():
            state[index[param]][name] = add(value.read()) if isinstance(value, Readable) \
                else value
        param_groups = []
        for param_group, params in self.param_groups:
            new_param_group = dict(param_group, params=[index[n] for n in params])
            if "param_names" in param_group:
                new_param_group["param_names"] = list(params)
            param_groups.append(new_param_group)
        return {"state": state, "param_groups": param_groups}, names


def holding(names: Sequence[str]) -> str:
    """Names a shard in a message by the unwrapped parameters it holds, not by its state
    dict key (which spells out the wrapper's separators)."""
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return f"the shard of {names[0] if names else '(no parameter)'}{more}"


def model_order(order: Sequence[str]) -> Callable[[str], int]:
    """A sort key putting parameter names in the unwrapped model's ``order`` (its
    ``parameters()``', the order an optimizer built over the unwrapped model holds them in),
    names it lacks last: how every writer lists a param group's parameters."""
    rank = {name: i for i, name in enumerate(order)}
    return lambda name: rank.get(name, len(rank))


Member = Tuple[str, str, int]  # a parameter's name, its shard's key, the shard's optimizer index


def named_state(param_groups: Sequence[Tuple[Dict[str, Any], List[Member]]],
                order: Sequence[str], state_of: Callable[[Member], Optional[Dict[str, Any]]]
                ) -> NamedState:
    """The one rule by which a sharded optimizer's state is named, for files and live
    models alike: each saved param group (with the parameters of the shards it holds) lists
    them in the unwrapped model's ``order`` (an optimizer built over the unwrapped model
    holds them so: ``model_order``), and each parameter whose shard has state gets
    ``state_of`` it."""
    key = model_order(order)
    out = NamedState()
    for param_group, members in param_groups:
        members = sorted(members, key=lambda m: key(m[0]))
        for member in members:
            state = state_of(member)
            if state is not None:
                out.state[member[0]], out.shard[member[0]] = state, member[1]
        out.param_groups.append((param_group, [m[0] for m in members]))
    return out


@dataclass
class UnwrappedState:
    """What a consolidated checkpoint holds, not read yet."""
    tensors: Dict[str, Readable]        # the state dict's entries, aliases aside, in order
    aliases: List[Tuple[str, str]]      # (alias, source) of tied parameters
    optimizer: Optional[NamedState]     # None: written without the optimizer
    extra: Dict[str, Any]               # {EXTRA: what the training code saved}, or empty

    def entries(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(name, tensor) of the model's entries, aliases aside, read one at a time."""
        for name, tensor in self.tensors.items():
            yield name, tensor.read()

    def with_aliases(self, entries: Dict[str, Any]) -> Dict[str, Any]:
        """``entries`` (by name, aliases aside) with each tied alias given its source's
        value, the same object: a tied parameter under every name, as ``state_dict()`` has
        it."""
        for alias, source in self.aliases:
            entries[alias] = entries[source]
        return entries

    def specs(self) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
        """(name, dtype, shape) of every entry ``entries`` yields, then of the aliases."""
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]
        source = {n: (d, s) for n, d, s in specs}
        return specs + [(alias, *source[src]) for alias, src in self.aliases]

    def read_order(self, aliases_again: bool) -> List[Any]:
        """What a writer reads, in the order it reads it: the model's entries, the tied
        aliases again when ``aliases_again`` (DCP stores each under its own key), then the
        optimizer's state in ``NamedState.in_read_order``."""
        order: List[Any] = list(self.tensors.values())
        if aliases_again:
            order += [self.tensors[source] for _, source in self.aliases]
        if self.optimizer is not None:
            order += [value for _, _, value in self.optimizer.in_read_order()]
        return order
