"""UnitModule: what every FSDP unit is as an ``nn.Module``, whatever runs its modules.

Two kinds of unit stand in a wrapped model: ``XlaFullyShardedDataParallel``, whose hooks
gather a unit's full parameters around its modules' forward and backward, and
``ScannedLayers``, whose loop gathers one layer of a stack at a time. Both compose the same
core (``_unit``: a ``UnitState`` with its ``UnitParams`` and shard groups; ``_sharding``: the
collectives), and both are this class: its shards, its settings, and the calls on a root
unit that concern the whole model (clipping, ``no_sync``, state dicts). What differs is
only how a kind shards its modules at construction (``_shard_members``), what state drives
it (``_new_state``: the wrapper's hooks it on its modules and gradients, the stack's hooks
nothing) and how it runs them (``forward``); neither kind switches off anything of the
other's.
"""
from __future__ import annotations

import contextlib
import math
from typing import (Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    Union)

import torch
import torch.nn as nn

from ._init.meta_init import materialize_meta
from ._init.module_group import attach_module_groups
from ._init.shard_members import ShardedParameters
from ._init.validate import mark_wrapped
from ._sharding.collectives import Collectives
from ._sharding.layout import Dim0Layout
from ._sharding.names import GROUP_PREFIX, clean_name
from ._unit import process_effects
from ._unit.conversions import check_conversion, shards_kept_out
from ._unit.host_offload import split_by_place
from ._unit.module_view import FallThrough, start_writing_through
from ._unit.options import FsdpOptions, default_predivide_factor
from ._unit.param_record import ParamRecord, unit_state_dict
from ._unit.shard_group import ShardGroup
from ._unit.training_state import TrainingState
from ._unit.unit_params import FullParams, UnitParams
from ._unit.unit_state import UnitState
from ._xla.patched_linear import patch_linear_layers
from ._xla.private_api import CollectiveBindings, incompatible_keys
from ._xla.trace_only import scalar_to_device
from .checkpoint.full_state_dict import (full_state_dict, load_full_optim_state_dict,
                                         load_full_state_dict)
from .checkpoint.formats.per_rank import shard_metadata
from .checkpoint.live_model import original_names_and_shards, sharding_group_index


def _local_norm(grads: List[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type`` norm of ``grads`` (all on one device; zero for none), in float32."""
    zero = [torch.zeros((), device=grads[0].device if grads else None)]
    if norm_type == math.inf:
        return torch.stack(zero + [g.abs().max().float() for g in grads]).max()
    return torch.stack(zero + [g.norm(norm_type).float() for g in grads]).norm(norm_type)


def _option(name: str) -> Any:
    """A unit's attribute for one of its options, which are set at construction only."""
    def get(unit: "UnitModule") -> Any:
        return getattr(unit.options, name)

    def refuse(unit: "UnitModule", _value: Any) -> None:
        raise AttributeError(f"FSDP unit around {unit.unit_state.name}: {name} is set when the "
                             f"unit is built (an argument of its constructor), not after")
    return property(get, refuse, doc=f"The ``{name}`` the unit was built with.")


class UnitModule(FallThrough):
    """An FSDP unit: the modules it holds (``wrapped_module``), this rank's shards of their
    parameters, and the state that drives them (``_state``). A kind of unit says how it
    shards its modules (``_shard_members``) and runs them (``forward``)."""

    def __init__(self, members: List[nn.Module], wrapped: nn.Module, options: FsdpOptions,
                 name: str, detached: bool, compile_refusal: Optional[str]) -> None:
        """Builds the parts every unit has: the options, the collectives, the members
        materialized on the host and the unit's state; then, unless the unit is a detached
        grouping (attached later, see ``_init.module_group``), shards ``wrapped`` as this
        kind does and becomes the parent of the units built below it."""
        super().__init__()
        self._options = options
        self._collectives = Collectives(self.world_size, self.sharding_groups,
                                        options.pin_layout_in_collective_ops,
                                        CollectiveBindings(), self.rank,
                                        options.dummy_collectives)
        for m in members:
            materialize_meta(m, options.param_init_fn)
            if options.use_xla_patched_linear:
                patch_linear_layers(m)
        self._fsdp_wrapped_module = wrapped
        import torch_xla
        self.xla_device = torch_xla.device()
        self._shared_params: List[Tuple[str, str]] = []  # (alias, source) names
        self._param_order: List[str] = []
        self._state = self._new_state(name, members,
                                      UnitParams(self._collectives, options, self.xla_device),
                                      detached, compile_refusal)
        pre = default_predivide_factor(self.world_size)
        self.set_gradient_divide_factors(pre, self.world_size / pre, False)
        self.register_load_state_dict_post_hook(_after_load)
        self.register_state_dict_pre_hook(_before_save)
        if not detached:
            attach_module_groups(self)
            self._shard([("", wrapped)])
            self._state.adopt([u._state for u in self.units()])
        process_effects.install()
        if options.execute_sharding_on_init:
            torch_xla.sync()
        mark_wrapped(wrapped, self)   # last: a wrap that raised leaves the module unwrapped
        start_writing_through(self)

    # -- sharding at construction ------------------------------------------------------------
    @property
    def is_attached(self) -> bool:
        return not self._state.detached

    def attach(self, member_paths: List[str]) -> None:
        """Shards a grouping unit's modules, named as in the unit that attaches it (see
        ``_init.module_group``)."""
        self._state.mark_attached()
        self._shard(list(zip(member_paths, self._state.members)))

    def _shard(self, roots: List[Tuple[str, nn.Module]]) -> None:
        sharded = self._shard_members(roots)
        for g in sharded.shard_groups:
            self.register_parameter(g.shard_name, g.shard)
        self._state.add_shard_groups(sharded.shard_groups)
        self._shared_params = sharded.shared_params
        self._param_order = sharded.param_order

    def _shard_members(self, roots: List[Tuple[str, nn.Module]]) -> ShardedParameters:
        """Shards the parameters below ``roots`` ((name prefix, module) pairs) and places
        their buffers, as this kind of unit runs them."""
        raise NotImplementedError

    def _new_state(self, name: str, members: List[nn.Module], params: UnitParams,
                   detached: bool, compile_refusal: Optional[str]) -> UnitState:
        """The state that drives this kind of unit."""
        raise NotImplementedError

    # -- public surface ---------------------------------------------------------------------
    @property
    def wrapped_module(self) -> nn.Module:
        """The wrapped module (its parameters are full-parameter placeholders)."""
        return self._fsdp_wrapped_module

    @property
    def unit_state(self) -> UnitState:
        """The state that drives this unit (``_unit.unit_state``): its hooks, its shard
        groups and the root's context."""
        return self._state

    @property
    def shard_groups(self) -> List[ShardGroup]:
        """This unit's shard groups (not its nested units'), read by checkpoint code."""
        return list(self._state.params.shard_groups)

    @property
    def shared_params(self) -> List[Tuple[str, str]]:
        """(alias, source) names, relative to this unit, of parameters held under several."""
        return list(self._shared_params)

    @property
    def param_order(self) -> List[str]:
        """This unit's parameter names in the order the unwrapped modules register them."""
        return list(self._param_order)

    @property
    def options(self) -> FsdpOptions:
        return self._options

    # torch_xla's attributes for its constructor's arguments, read-only: set after
    # construction, torch_xla reads some of them and not others, and a unit none of them
    rank = _option("rank")
    world_size = _option("world_size")
    sharding_groups = _option("sharding_groups")
    flatten_parameters = _option("flatten_parameters")
    compute_dtype = _option("compute_dtype")
    buffer_dtype = _option("buffer_dtype")
    fp32_reduce_scatter = _option("fp32_reduce_scatter")
    disable_reshard_on_root = _option("disable_reshard_on_root")
    optimization_barrier_in_forward = _option("optimization_barrier_in_forward")
    optimization_barrier_in_backward = _option("optimization_barrier_in_backward")
    sync_on_finalization = _option("sync_on_finalization")
    coalesce_all_gather_ops = _option("coalesce_all_gather_ops")
    _shard_param_on_dim_0 = _option("shard_param_on_dim_0")
    _shard_size_multiple = _option("shard_size_multiple")

    @property
    def collectives(self) -> Collectives:
        return self._collectives

    @property
    def sharded_params(self) -> List[nn.Parameter]:
        return [g.shard for g in self._state.params.shard_groups]

    @property
    def params_with_grad(self) -> List[nn.Parameter]:
        """This unit's parameters (shards, and any unsharded ones) that have a gradient."""
        return [p for p in self.parameters() if p.grad is not None]

    @property
    def full_params(self) -> List[torch.Tensor]:
        return [p for g in self._state.params.shard_groups for p in g.placeholders]

    @property
    def training_state(self) -> TrainingState:
        return self._state.training_state

    @property
    def has_full_params(self) -> bool:
        return self._state.params.state is FullParams.UNSHARDED

    @property
    def gradient_predivide_factor(self) -> float:
        return self._state.params.divide_factors[0]

    @property
    def gradient_postdivide_factor(self) -> float:
        return self._state.params.divide_factors[1]

    def _apply(self, fn: Callable, recurse: bool = True) -> "UnitModule":
        # torch's .to(), .half(), .cpu()...: see [Note: converting a wrapped model]
        for path, unit in self.named_units():
            check_conversion(unit._state.name, clean_name(path), unit._state.params.shard_groups,
                             fn)
        with shards_kept_out(self, [g.shard_name for g in self._state.params.shard_groups]):
            return super()._apply(fn, recurse)

    def apply(self, fn: Callable[[nn.Module], None]) -> "UnitModule":
        """``fn`` on every module, as on the unwrapped model (an initialisation, e.g.
        transformers' ``_init_weights``): while it runs over a unit's modules they hold the
        unit's full parameters, in their own dtype, and what ``fn`` writes to them (in place
        or through ``.data``) goes into the shards after, as PyTorch FSDP's ``apply`` does.
        One unit's full parameters at a time, with its enclosing units'. It gathers, so every
        rank calls it, as every rank runs the forward."""
        self.assert_state(TrainingState.IDLE)
        with self._state.params.full_values_written_back():
            return super().apply(fn)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "UnitModule":
        # [Note: a unit is not copied] A copy's modules would hold copies of the
        # placeholders, and its forward would run hooks bound to this unit: it gathered
        # this unit's shards into this unit's placeholders and computed with what the copy
        # held (nothing, or the values of the moment it was copied), and its backward
        # reduced nothing, so an EMA or evaluation copy failed deep in XLA or went silently
        # wrong
        raise TypeError(
            f"FSDP unit around {type(self.wrapped_module).__name__} cannot be deep-copied. "
            f"Copy the model before wrapping it and wrap the copy the same way: its shards "
            f"then pair with these ones (an EMA over zip(ema.parameters(), "
            f"model.parameters())). For torch.optim.swa_utils.AveragedModel, build it over "
            f"the unwrapped model and wrap its .module")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"FSDP unit around {type(self.wrapped_module).__name__} cannot be pickled "
            f"(torch.save(model), pickle): save its state instead, with full_state_dict() or "
            f"xla_fsdp.checkpoint's save_sharded, save_consolidated or save_dcp")

    def extra_repr(self) -> str:
        params = self._state.params
        padded = [n for g in params.shard_groups if isinstance(g.layout, Dim0Layout)
                  and g.layout.pad_rows for n in g.names]
        text = (f"world_size={self.world_size}, rank={self.rank}, "
                f"compute_dtype={self.compute_dtype}, flatten_parameters="
                f"{self.flatten_parameters}, reshard_after_forward={params.reshard_after_forward}, "
                f"sharding_groups={self.sharding_groups}")
        if padded:
            text += f", dim0_padded={padded}"
        return text

    def units(self) -> Iterator["UnitModule"]:
        """This unit and every unit nested in it."""
        return (unit for _, unit in self.named_units())

    def named_units(self) -> Iterator[Tuple[str, "UnitModule"]]:
        """(path in the wrapped model, unit) for this unit and every unit nested in it, each
        once, in the order ``named_modules`` first finds them. A unit reachable under more
        than one path (also kept as an attribute of the model) is at the first, but a
        grouping unit is where the unit that attached it holds it (``_fsdp_group_<i>``): its
        parameters are named from there."""
        found: Dict[int, Tuple[str, "UnitModule"]] = {}
        for path, m in self.named_modules(remove_duplicate=False):
            if isinstance(m, UnitModule) and (id(m) not in found or
                                              path.rpartition(".")[2].startswith(GROUP_PREFIX)):
                found[id(m)] = (path, m)   # a key keeps its first place when replaced
        yield from found.values()

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool) -> None:
        """Gradients are divided by ``pre`` before the reduce-scatter and by ``post`` after it
        (defaults: a power of two near sqrt(N), and N / pre), as in torch_xla's FSDP: a factor
        of 1 or less divides by nothing, and ``(1, 1)`` averages over the N ranks after the
        sum. A float32 reduction needs no headroom, so there both divisions happen after it."""
        self.assert_state(TrainingState.IDLE)
        for unit in (self.units() if recursive else [self]):
            unit._state.params.set_divide(float(pre), float(post), unit.world_size)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulates full, unreduced gradients until the first backward after the context.

        Costs the memory of full gradients for every unit; saves one reduce-scatter per
        accumulation step. An accumulation abandoned with ``optimizer.zero_grad()`` (or
        ``model.zero_grad()``) before a synchronised backward is dropped, as the unsharded
        gradients would be."""
        self.check_root_call("no_sync")
        saved = [(u._state.params, u._state.params.sync_gradients) for u in self.units()]
        for params, _ in saved:
            params.set_sync_gradients(False)
        try:
            yield
        finally:
            for params, flag in saved:
                params.set_sync_gradients(flag)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0,
                        groups: Optional[List[List[int]]] = None) -> torch.Tensor:
        """Clips the gradients of all units by their total norm, as if unsharded.

        ``groups`` are the replica groups to reduce the norm over. By default all ranks, each
        of which holds a different shard (with ``sharding_groups``, each group a different
        part of the model), or with ``replicate_across_groups`` the sharding groups, each of
        which holds the whole model once. Every rank takes part in the reduction, also one
        whose parameters got no gradient."""
        self.check_root_call("clip_grad_norm_")
        pending = [n for _, unit in self.named_units() for g in unit._state.params.shard_groups
                   if g.accumulating() for n in g.names]
        if pending:
            # the accumulated gradients wait on the full parameters until the synchronised
            # backward reduces them: the shards hold none to clip, and a change to a shard's
            # gradient counts as dropping the accumulation
            raise RuntimeError(
                f"clip_grad_norm_ inside a no_sync() accumulation ({', '.join(pending[:3])}"
                f"{', ...' if len(pending) > 3 else ''}: micro-batches not reduced yet): clip "
                f"after the backward outside "
                f"no_sync(), before the optimizer step (Lightning: clip_gradients only on the "
                f"step that does not accumulate)")
        if groups is None:
            groups = self._options.sharding_groups if self._options.replicate_across_groups \
                else None
        norm_type = float(norm_type)
        # offloaded shards' gradients are on the host: their part of the norm is taken there
        # and only that scalar goes through the device's all-reduce (one small execution)
        places = split_by_place([p.grad for p in self.params_with_grad])
        parts = [scalar_to_device(_local_norm(grads, norm_type), self.xla_device)
                 for grads in places if grads]
        local = parts[0] if len(parts) == 1 else \
            scalar_to_device(_local_norm(parts, norm_type), self.xla_device)
        if norm_type == math.inf:
            total = self._collectives.all_reduce_max(local, groups)
        else:
            total = self._collectives.all_reduce_sum(local ** norm_type, groups) \
                ** (1.0 / norm_type)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        on_device, on_host = places
        for g in on_device:
            g.mul_(coef)
        host_coef = coef.cpu() if on_host else None
        for g in on_host:
            g.mul_(host_coef)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drops full gradients a ``no_sync`` backward left unreduced."""
        super().zero_grad(set_to_none)
        for unit in self.units():
            unit._state.params.drop_abandoned()

    def get_original_names_and_sharded_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        """(name in the unwrapped model, shard) for every shard of every unit in this tree."""
        return original_names_and_shards(self.named_units())

    def full_state_dict(self, rank0_only: bool = True) -> Dict[str, torch.Tensor]:
        """The unwrapped model's state dict on the CPU (see ``full_state_dict.py``)."""
        self.check_root_call("full_state_dict")
        return full_state_dict(self, rank0_only)

    def load_full_state_dict(self, state_dict: Dict[str, torch.Tensor],
                             strict: bool = True) -> Tuple[List[str], List[str]]:
        """Loads an unwrapped model's state dict, e.g. a consolidated checkpoint, at any
        world size: each rank keeps only its shard."""
        self.check_root_call("load_full_state_dict")
        return load_full_state_dict(self, state_dict, strict)

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """This rank's shards and the buffers, under the unit's names. The modules inside
        refuse a ``state_dict()`` of their own (see [Note: state_dict() below a unit])."""
        with unit_state_dict():
            return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """This unit's own state dict, as ``state_dict()`` gives it (this rank's shards); on
        the root also an unwrapped model's, such as a consolidated checkpoint or what Hugging
        Face Trainer loads its best checkpoint from, which loads as ``load_full_state_dict``
        loads it (every rank calls it). Given to torch's loader, no key of an unwrapped
        model's state dict matches a unit's, so ``strict=False`` would load nothing. A state
        dict saved by torch_xla's FSDP is refused, and so is an unwrapped state dict given to
        a nested unit (or to a module inside a unit: see ``ParamRecord``), which would load
        nothing."""
        _refuse_torch_xla_names(self, state_dict)
        if state_dict and _unwrapped_names(self, state_dict):
            if not self._state.is_root:
                raise ValueError(
                    f"FSDP unit around {self._state.name}: load_state_dict() got an unwrapped "
                    f"module's state dict (e.g. {next(iter(state_dict))!r}), but this unit is "
                    f"nested in another, and only the root loads one (its ranks agree on the "
                    f"whole model). Load it through the root, under the names the root's "
                    f"full_state_dict() gives these parameters, with strict=False for a part "
                    f"of the model. Nothing was loaded.")
            return incompatible_keys(*self.load_full_state_dict(dict(state_dict), strict))
        return super().load_state_dict(state_dict, strict, assign)

    def load_full_optim_state_dict(self, optimizer: torch.optim.Optimizer,
                                   optim_state_dict: Dict[str, Any],
                                   param_names: Optional[List[str]] = None) -> None:
        """Loads the state of an optimizer over the unwrapped model into ``optimizer`` at any
        world size (see ``full_state_dict.py``)."""
        self.check_root_call("load_full_optim_state_dict")
        load_full_optim_state_dict(self, optimizer, optim_state_dict, param_names)

    def get_shard_metadata(self) -> Dict[str, Any]:
        """What consolidation needs, in torch_xla's format (see ``checkpoint.formats.per_rank``)."""
        index = sharding_group_index(self)
        return shard_metadata(self, self.named_units(), self.world_size, self.rank,
                              None if index is None else
                              (index, self.options.replicate_across_groups))

    def check_root_call(self, what: str) -> None:
        """Raises unless this is the root unit and it is idle: ``what`` concerns the whole
        model (saving, loading, clipping)."""
        if not self._state.is_root:
            raise RuntimeError(
                f"{what}() must be called on the root FSDP unit, not on a nested unit "
                f"({self._state.name}); call it on the outermost wrapper")
        self.assert_state(TrainingState.IDLE)

    # -- state ---------------------------------------------------------------------------------
    def assert_state(self, state: Union[TrainingState, Sequence[TrainingState]]) -> None:
        """Raises ``TrainingStateError`` unless the unit is in ``state`` (or one of them)."""
        self._state.assert_state([state] if isinstance(state, TrainingState) else list(state))


def _unwrapped_names(root: UnitModule, state_dict: Mapping[str, Any]) -> bool:
    """Whether ``state_dict`` names no entry of the wrapped model's state dict."""
    with unit_state_dict():
        wrapped = set(nn.Module.state_dict(root, keep_vars=True))
    return not any(k in wrapped for k in state_dict)


def _refuse_torch_xla_names(unit: UnitModule, state_dict: Mapping[str, Any]) -> None:
    """A state dict saved from torch_xla's FSDP names what its flattener wrapped
    (``_fpw_module``), which no unit here has, and pads and cuts its shards as this wrapper
    does not: loaded as it is, it would load nothing under ``strict=False`` and, where names
    and shapes happen to agree, the wrong elements. Refused, pointing to the loaders that
    read torch_xla's per-rank files by their shard metadata."""
    theirs = next((k for k in state_dict if "_fpw_module" in k), None)
    if theirs is not None:
        raise ValueError(
            f"FSDP unit around {unit.unit_state.name}: load_state_dict() got a state dict "
            f"saved by torch_xla's FSDP (key {theirs!r}), whose shards are padded and cut "
            f"otherwise than this wrapper's. Load torch_xla's per-rank files (the "
            f"{{'model': ..., 'shard_metadata': ...}} dicts) with "
            f"xla_fsdp.checkpoint.load_sharded(prefix, model, optimizer), at any world size, "
            f"or merge them with consolidate_sharded_ckpts. Nothing was loaded.")


def _before_save(unit: UnitModule, _prefix: str, _keep_vars: bool) -> None:
    """A write through a module attribute since the unit was freed is not in its shards:
    refused rather than saved without it (see [Note: writes to a freed placeholder])."""
    for g in unit.shard_groups:
        ParamRecord.refuse_lost_writes(g.records)


def _after_load(unit: UnitModule, _incompatible: Any) -> None:
    """``load_state_dict`` wrote the shards, or with ``assign=True`` replaced them: keep the
    shards the optimizer and the unit hold (moving the loaded values into them) and count
    the update, so that full parameters gathered before it are not reused."""
    own = dict(unit.named_parameters(recurse=False))
    for g in unit.shard_groups:
        loaded = own.get(g.shard_name)
        if loaded is not None and loaded is not g.shard:
            with torch.no_grad():
                g.shard.copy_(loaded.detach().to(g.shard.device, g.shard.dtype))
            unit.register_parameter(g.shard_name, g.shard)
        g.mark_updated()
