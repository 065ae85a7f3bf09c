"""XlaFullyShardedDataParallel: ZeRO-3 sharding of an ``nn.Module`` on XLA devices.

Each unit keeps only this rank's shard of its parameters. The original parameters stay in
their modules as *full-parameter placeholders* (``_unit.param_record``): leaf tensors that
hold the all-gathered full value while the unit computes and a one-element dummy otherwise.
Autograd still sees one leaf per original parameter, so gradients arrive per parameter; they
are reduce-scattered into the shard's ``.grad`` once every parameter of a shard group has its
gradient.

This module is the public class: construction and the methods users call. The work is in
the layers below it (see ARCHITECTURE.md): ``_init`` (finding and grouping parameters),
``_unit`` (one state object per unit, owning its hooks and shard groups), ``_sharding``
(layouts and collectives) and ``checkpoint`` (state dicts and shard metadata).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ._init.compiled_module import split_compiled
from ._init.find_parameters import find_parameters, shard_group_members
from ._init.meta_init import materialize_meta
from ._init.mixed_precision import float32_modules, run_in_float32
from ._init.module_group import ModuleGroup, attach_module_groups, check_members, mark_grouped
from ._init.validate import validate_first_forward, validate_group_arguments, validate_module
from ._sharding.collectives import Collectives
from ._sharding.layout import Dim0Layout
from ._unit import process_effects
from ._unit.buffers import place_buffers
from ._unit.conversions import check_conversion, shards_kept_out
from ._unit.host_offload import split_by_place
from ._unit.module_view import FallThrough, ModuleView
from ._unit.options import FsdpOptions, default_predivide_factor
from ._unit.param_record import Owner
from ._unit.shard_group import ShardGroup, build_shard_group
from ._unit.training_state import TrainingState
from ._unit.unit_params import FullParams, UnitParams
from ._unit.unit_state import UnitState
from ._xla.patched_linear import patch_linear_layers
from ._xla.private_api import CollectiveBindings
from .checkpoint.full_state_dict import (full_state_dict, load_full_optim_state_dict,
                                         load_full_state_dict)
from .checkpoint.metadata import original_names_and_shards, shard_metadata
from .wrap import recursive_wrap


# the constructor's arguments that are not options (what to wrap, and how to wrap inside it),
# and the names Python adds to its locals()
_NOT_OPTIONS = ("self", "__class__", "module", "auto_wrap_policy", "auto_wrapper_callable")


@dataclass
class ShardedParameters:
    """What sharding a unit's modules produced (``_shard_members``)."""
    shard_groups: List[ShardGroup]
    shared_params: List[Tuple[str, str]]   # (alias, source) names of tied parameters
    param_order: List[str]                 # names in the unwrapped modules' order


def _local_norm(grads: List[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type`` norm of ``grads`` (all on one device; zero for none), in float32."""
    zero = [torch.zeros((), device=grads[0].device if grads else None)]
    if norm_type == math.inf:
        return torch.stack(zero + [g.abs().max().float() for g in grads]).max()
    return torch.stack(zero + [g.norm(norm_type).float() for g in grads]).norm(norm_type)


class XlaFullyShardedDataParallel(FallThrough):
    """Shards ``module``'s parameters across the ranks of a sharding group (ZeRO-3).

    Drop-in for ``torch_xla.distributed.fsdp.XlaFullyShardedDataParallel``: same arguments,
    same defaults off a TPU, same checkpoint format (flattened groups aside, below).
    Differences, each a fix:

    * on a TPU, ``shard_param_on_dim_0`` and ``coalesce_all_gather_ops`` default to True:
      row-block shards libtpu reads without relayout, gathered in one unpinned all-gather
      per unit that it runs beside compute (see [Note: defaults that depend on the
      hardware] in ``_unit/options.py``); pass False for torch_xla's flat shards;
    * auto-wrapped children receive every option, including ``reduce_scatter_bucket_size_mb``
      and ``coalesce_all_gather_ops`` (torch_xla drops them);
    * ``coalesce_all_gather_ops`` works in every mode, flattened included (torch_xla crashes);
    * ``reduce_scatter_bucket_size_mb > 0`` works with pinned layouts, the default (torch_xla's
      coalesced reduce-scatter aborts the process there);
    * ``get_original_names_and_sharded_parameters`` covers nested units (torch_xla repeats
      the root's parameters);
    * ``replicate_across_groups=True`` makes ``sharding_groups`` data-parallel replicas
      (hybrid sharding): gradients averaged across groups, the norm over one group, one
      group writes checkpoints. Without it each group is a model of its own, as torch_xla
      means it, and each writes its own checkpoint files;
    * BatchNorm computes in float32 under a low-precision ``compute_dtype``, and buffers
      keep their dtype unless ``buffer_dtype`` is given (torch_xla casts them to the
      compute dtype);
    * under a low-precision ``compute_dtype`` attention's matmuls run in it too (torch's
      ``scaled_dot_product_attention`` would cast them to float32) and backward keeps its
      probabilities in it, not in float32 (see [Note: attention under a low-precision
      compute_dtype] in ``_unit/low_precision_attention.py``);
    * ``zero_missing_gradients=True`` keeps ranks' collectives identical when their data
      leave different parameters without a gradient;
    * parameters are padded only to what the collectives need (a multiple of the world size),
      not to ``128 * world_size`` elements, so a bias of 10 stays 10 (plus at most N-1);
    * all-gathers are native all-gathers even with ``pin_layout_in_collective_ops=True``;
      forward ones are off torch_xla's collective token chain, and a unit's rank-1 pieces
      (flat shards) go out unpinned in one all-gather, which libtpu then runs beside
      compute (see [Note: collectives off the token chain]; see [Note: a rank-1 gather
      needs no pinned layout]);
    * the full parameters are never copied to the device while sharding;
    * ``flatten_parameters=True`` still gives the optimizer one tensor per unit, but each
      parameter is sharded on its own and a rank's shard interleaves its piece of every
      parameter, so each parameter is all-gathered into a buffer of its own. torch_xla
      gathers one flat buffer per unit and slices the parameters out of it, and a backward
      fusion that reads a bias from that buffer keeps the whole unit alive until backward.
      The checkpoint records these groups as ``interleaved`` (see ``checkpoint.metadata``);
    * the step updates the shards and the optimizer state in place: torch_xla 2.9 lets XLA
      pair donated buffers with outputs by size and order, which copies every shard and
      optimizer state tensor in and out of each step (see ``donation_order``);
    * an optimizer built before wrapping, or ``xm.optimizer_step`` on sharded gradients, is
      an error at the optimizer step instead of silently wrong training;
    * ``.to()``, ``.half()``, ``.cpu()`` and the like never replace a shard: moving an
      offloaded model to its device keeps its host shards, other moves and casts are
      refused (see [Note: converting a wrapped model] in ``_unit/conversions.py``);
    * ``offload_optimizer=True`` (not in torch_xla) keeps each rank's shards, their
      gradients and so the optimizer's state on the host, where the optimizer steps; the
      device holds a compute-dtype copy of each shard (see [Note: the optimizer on the
      host] in ``_unit/host_offload.py``). Clip with this model's ``clip_grad_norm_``.

    Parameters must be float32 (they are the master copy); ``compute_dtype`` sets the dtype
    of the gathered full parameters.
    """

    _calls_wrapped_module = True  # False for a unit that runs its modules itself (a scan)

    def __init__(
        self,
        module: Union[nn.Module, Sequence[nn.Module]],
        reshard_after_forward: bool = True,
        flatten_parameters: bool = False,
        execute_sharding_on_init: bool = True,
        optimization_barrier_in_forward: bool = True,
        optimization_barrier_in_backward: bool = True,
        sync_on_finalization: bool = False,
        disable_reshard_on_root: bool = True,
        compute_dtype: Optional[torch.dtype] = None,
        buffer_dtype: Optional[torch.dtype] = None,
        fp32_reduce_scatter: bool = False,
        sharding_groups: Optional[List[List[int]]] = None,
        sharding_rank: Optional[int] = None,
        sharding_world_size: Optional[int] = None,
        shard_param_on_dim_0: Optional[bool] = None,
        pin_layout_in_collective_ops: bool = True,
        reduce_scatter_bucket_size_mb: Optional[int] = 0,
        coalesce_all_gather_ops: Optional[bool] = None,
        auto_wrap_policy: Optional[Callable] = None,
        auto_wrapper_callable: Optional[Callable] = None,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        _shard_size_multiple: int = 1,
        _use_xla_patched_linear: bool = True,
        _debug_dummy_forward_pass: bool = False,
        _debug_msg: str = "xla_fsdp",
        _debug_print: bool = False,
        _debug_dummy_all_gather_op: bool = False,
        _debug_dummy_all_reduce_op: bool = False,
        _debug_dummy_reduce_scatter_op: bool = False,
        _debug_dummy_optimization_barrier_op: bool = False,
        mark_step_on_finalization: Optional[bool] = None,
        on_neuron: bool = False,
        replicate_across_groups: bool = False,
        zero_missing_gradients: bool = False,
        offload_optimizer: bool = False,
    ) -> None:
        # every other argument is an option, by torch_xla's name (FsdpOptions.from_arguments)
        arguments = {k: v for k, v in locals().items() if k not in _NOT_OPTIONS}
        grouping = isinstance(module, (list, tuple))
        compiled = None  # the torch.compile'd module to call, when given one
        if grouping:
            members = check_members(module)
            validate_group_arguments(auto_wrap_policy)
        else:
            module, compiled = split_compiled(module)
            validate_module(module, self._calls_wrapped_module)
            members = [module]
        options = FsdpOptions.from_arguments(arguments)
        super().__init__()
        if auto_wrap_policy is not None:
            recursive_wrap(module, auto_wrap_policy,
                           wrapper_cls=auto_wrapper_callable or XlaFullyShardedDataParallel,
                           only_wrap_children=True, **options.as_arguments())
        self._options = options
        self.rank, self.world_size = options.rank, options.world_size
        self.sharding_groups = options.sharding_groups
        self.flatten_parameters = options.flatten_parameters
        self.compute_dtype, self.buffer_dtype = options.compute_dtype, options.buffer_dtype
        self._collectives = Collectives(self.world_size, self.sharding_groups,
                                        options.pin_layout_in_collective_ops,
                                        CollectiveBindings(), self.rank,
                                        options.dummy_collectives)
        for m in members:
            materialize_meta(m, param_init_fn)
            if options.use_xla_patched_linear:
                patch_linear_layers(m)
        self._fsdp_wrapped_module = ModuleGroup(members) if grouping else module
        # called instead of the wrapped module, not registered: its parameters are the
        # wrapped module's (see [Note: FSDP's hooks under torch.compile])
        self.__dict__["_compiled_module"] = compiled
        import torch_xla
        self.xla_device = torch_xla.device()
        self._shared_params: List[Tuple[str, str]] = []  # (alias, source) names
        self._param_order: List[str] = []
        self._state = UnitState(self, type(members[0]).__name__ if not grouping else
                                "+".join(type(m).__name__ for m in members), members,
                                UnitParams(self._collectives, options, self.xla_device),
                                options, detached=grouping,
                                first_forward_check=validate_first_forward,
                                compile_refusal=self.compile_refusal())
        pre = default_predivide_factor(self.world_size)
        self.set_gradient_divide_factors(pre, self.world_size / pre, False)
        self._state.hook_members([compiled] if compiled is not None else [])
        self.register_load_state_dict_post_hook(_after_load)
        if grouping:
            mark_grouped(members, self)
        else:
            attach_module_groups(self)
            self._shard([("", module)])
            self._state.adopt([u._state for u in self.units()])
        process_effects.install()
        if options.execute_sharding_on_init:
            torch_xla.sync()

    # -- public surface ---------------------------------------------------------------------
    @property
    def wrapped_module(self) -> nn.Module:
        """The wrapped module (its parameters are full-parameter placeholders)."""
        return self._fsdp_wrapped_module

    @property
    def module(self) -> nn.Module:
        """The wrapped module as torch_xla's ``unit.module`` presents it (see
        ``module_view``): attributes and calls reach the wrapped module, and
        ``unit.module.module`` is the wrapped module itself."""
        view = self.__dict__.get("_module_view")
        if view is None:
            view = self.__dict__["_module_view"] = ModuleView(self._fsdp_wrapped_module)
        return view

    @property
    def shard_groups(self) -> List[ShardGroup]:
        """This unit's shard groups (not its nested units'), read by checkpoint code."""
        return list(self._state.shard_groups)

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

    @property
    def collectives(self) -> Collectives:
        return self._collectives

    @property
    def sharded_params(self) -> List[nn.Parameter]:
        return [g.shard for g in self._state.shard_groups]

    @property
    def params_with_grad(self) -> List[nn.Parameter]:
        """This unit's parameters (shards, and any unsharded ones) that have a gradient."""
        return [p for p in self.parameters() if p.grad is not None]

    @property
    def full_params(self) -> List[torch.Tensor]:
        return [p for g in self._state.shard_groups for p in g.placeholders]

    @property
    def training_state(self) -> TrainingState:
        return self._state.training_state

    @property
    def has_full_params(self) -> bool:
        return self._state.params.state is FullParams.UNSHARDED

    @property
    def reshard_after_forward(self) -> bool:
        return self._state.reshard_after_forward

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool) -> None:
        self._state.set_reshard_after_forward(value)

    @property
    def reshard_after_backward(self) -> bool:
        return self._state.params.reshard_after_backward

    @property
    def gradient_predivide_factor(self) -> float:
        return self._state.params.divide[0]

    @property
    def gradient_postdivide_factor(self) -> float:
        return self._state.params.divide[1]

    def _fall_through_to(self) -> Sequence[Any]:
        return (self._fsdp_wrapped_module,)  # code written for the module reads it off the unit

    def __getitem__(self, key: int) -> nn.Module:
        return self._fsdp_wrapped_module.__getitem__(key)

    def _apply(self, fn: Callable, recurse: bool = True) -> "XlaFullyShardedDataParallel":
        # torch's .to(), .half(), .cpu()...: see [Note: converting a wrapped model]
        for unit in self.units():
            check_conversion(unit._state.name, unit._state.shard_groups, fn)
        with shards_kept_out(self, [g.shard_name for g in self._state.shard_groups]):
            return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        padded = [n for g in self._state.shard_groups if isinstance(g.layout, Dim0Layout)
                  and g.layout.pad_rows for n in g.names]
        text = (f"world_size={self.world_size}, rank={self.rank}, "
                f"compute_dtype={self.compute_dtype}, flatten_parameters="
                f"{self.flatten_parameters}, reshard_after_forward={self.reshard_after_forward}, "
                f"sharding_groups={self.sharding_groups}")
        if padded:
            text += f", dim0_padded={padded}"
        return text

    def units(self) -> Iterator["XlaFullyShardedDataParallel"]:
        """This unit and every unit nested in it."""
        return (unit for _, unit in self.named_units())

    def named_units(self) -> Iterator[Tuple[str, "XlaFullyShardedDataParallel"]]:
        """(path in the wrapped model, unit) for this unit and every unit nested in it."""
        for path, m in self.named_modules():
            if isinstance(m, XlaFullyShardedDataParallel):
                yield path, m

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool) -> None:
        """Gradients are divided by ``pre`` before the reduce-scatter and by ``post`` after it
        (defaults: a power of two near sqrt(N), and N / pre). A float32 reduction needs no
        headroom, so there both divisions happen after it."""
        self.assert_state(TrainingState.IDLE)
        for unit in (self.units() if recursive else [self]):
            unit._state.params.set_divide(float(pre), float(post))

    # -- explicit control (FSDP2's names) ---------------------------------------------------
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the unit frees its full parameters after its forward (and gathers them
        again for backward). ``False`` saves one all-gather per unit and step and keeps the
        full parameters from forward to backward. Overrides ``disable_reshard_on_root``."""
        self.assert_state(TrainingState.IDLE)
        for unit in (self.units() if recurse else [self]):
            unit._state.set_reshard_after_forward(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool,
                                   recurse: bool = True) -> None:
        """Whether the unit frees its full parameters after its backward. ``False`` keeps
        them into the next forward, which then gathers nothing: for gradient accumulation,
        with ``True`` again before the last micro-batch. Parameters an optimizer step (or a
        load) has changed since they were gathered are gathered again, never reused."""
        self.assert_state(TrainingState.IDLE)
        for unit in (self.units() if recurse else [self]):
            unit._state.params.set_reshard_after_backward(bool(reshard_after_backward))

    def set_modules_to_forward_prefetch(
            self, modules: Sequence["XlaFullyShardedDataParallel"]) -> None:
        """Units whose all-gathers are issued when this unit's forward starts, usually the
        unit(s) that run next. The compiler may then overlap them with this unit's compute
        instead of running them after it; the cost is holding their full parameters for
        longer. Without it, a unit's gather is tied to its inputs, i.e. to the previous
        unit's output."""
        self._state.set_prefetch(forward=self._prefetch_targets(modules, "forward"))

    def set_modules_to_backward_prefetch(
            self, modules: Sequence["XlaFullyShardedDataParallel"]) -> None:
        """Units whose all-gathers are issued when this unit's backward starts, usually the
        unit(s) whose backward runs next (the ones before it in forward order)."""
        self._state.set_prefetch(backward=self._prefetch_targets(modules, "backward"))

    def _prefetch_targets(self, modules: Sequence[Any], which: str) -> List[UnitState]:
        modules = list(modules)
        for m in modules:
            if not isinstance(m, XlaFullyShardedDataParallel):
                raise TypeError(f"set_modules_to_{which}_prefetch takes FSDP units; got "
                                f"{type(m).__name__}, which is not wrapped in FSDP")
            if m is self:
                raise ValueError(f"set_modules_to_{which}_prefetch: a unit cannot prefetch "
                                 f"itself ({type(self.wrapped_module).__name__})")
        return [m._state for m in modules]

    def unshard(self) -> None:
        """Gathers this unit's full parameters now, in the graph being traced; its next
        forward uses them instead of gathering (then frees them if ``reshard_after_forward``).
        E.g. to start a unit's gather before unrelated work of the step."""
        self.assert_state(TrainingState.IDLE)
        self._state.unshard_now()

    def reshard(self) -> None:
        """Frees this unit's full parameters (and any gather issued for it)."""
        self.assert_state(TrainingState.IDLE)
        self._state.reshard_now()

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
        if groups is None:
            groups = self._options.sharding_groups if self._options.replicate_across_groups \
                else None
        norm_type = float(norm_type)
        # offloaded shards' gradients are on the host: their part of the norm is taken there
        # and only that scalar goes through the device's all-reduce (one small execution)
        places = split_by_place([p.grad for p in self.params_with_grad])
        parts = [_local_norm(grads, norm_type).to(self.xla_device) for grads in places if grads]
        local = parts[0] if len(parts) == 1 else \
            _local_norm(parts, norm_type).to(self.xla_device)
        if norm_type == math.inf:
            total = self._collectives.all_reduce_max(local, groups)
        else:
            total = self._collectives.all_reduce_sum(local ** norm_type, groups) ** (1.0 / norm_type)
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

    def load_full_optim_state_dict(self, optimizer: torch.optim.Optimizer,
                                   optim_state_dict: Dict[str, Any],
                                   param_names: Optional[List[str]] = None) -> None:
        """Loads the state of an optimizer over the unwrapped model into ``optimizer`` at any
        world size (see ``full_state_dict.py``)."""
        self.check_root_call("load_full_optim_state_dict")
        load_full_optim_state_dict(self, optimizer, optim_state_dict, param_names)

    def get_shard_metadata(self) -> Dict[str, Any]:
        """What consolidation needs, in torch_xla's format (see ``checkpoint.metadata``)."""
        return shard_metadata(self, self.named_units(), self.world_size, self.rank)

    def compile_refusal(self) -> Optional[str]:
        """Why this unit cannot run inside ``torch.compile``, or None: a subclass that runs
        its modules itself (a scan) says so, and a compiled model containing it is refused
        with that message (see [Note: FSDP's hooks under torch.compile])."""
        return None

    def check_root_call(self, what: str) -> None:
        """Raises unless this is the root unit and it is idle: ``what`` concerns the whole
        model (saving, loading, clipping)."""
        if not self._state.is_root:
            raise RuntimeError(
                f"{what}() must be called on the root FSDP unit, not on a nested unit "
                f"({self._state.name}); call it on the outermost wrapper")
        self.assert_state(TrainingState.IDLE)

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
        sharded = self._shard_members(roots, self._state.name)
        for g in sharded.shard_groups:
            self.register_parameter(g.shard_name, g.shard)
        self._state.add_shard_groups(sharded.shard_groups)
        self._shared_params = sharded.shared_params
        self._param_order = sharded.param_order

    def _shard_members(self, roots: List[Tuple[str, nn.Module]], unit_name: str
                       ) -> ShardedParameters:
        """Shards the parameters below ``roots`` ((name prefix, module) pairs) and places
        their buffers; ``ScannedLayers`` shards a stack of layers its own way."""
        opts = self._options
        found = find_parameters(roots, self)
        modules = [m for _, root in roots for m in root.modules()]
        fp32 = float32_modules(modules, self.compute_dtype)

        def dtype_of(owners: List[Owner]) -> torch.dtype:
            return torch.float32 if any(id(m) in fp32 for m, _ in owners) else self.compute_dtype

        shard_groups, shared = [], []
        for index, members in enumerate(shard_group_members(found, self.flatten_parameters,
                                                            dtype_of)):
            shard_groups.append(build_shard_group(
                members, index, flatten=self.flatten_parameters,
                dim0=opts.shard_param_on_dim_0, world_size=self.world_size, rank=self.rank,
                multiple=opts.shard_size_multiple, device=self.xla_device,
                compute_dtype=dtype_of(members[0][1]), unit_name=unit_name,
                offload=opts.offload_optimizer))
            for _, _, names in members:
                shared.extend((alias, names[0]) for alias in names[1:])
        for m in modules:
            if id(m) in fp32:
                run_in_float32(m, self.compute_dtype)
        for _, m in roots:
            place_buffers(m, self.buffer_dtype, self.xla_device, keep=fp32)
        return ShardedParameters(shard_groups, shared, [names[0] for _, _, names in found])

    # -- state ---------------------------------------------------------------------------------
    def assert_state(self, state: Union[TrainingState, Sequence[TrainingState]]) -> None:
        """Raises ``TrainingStateError`` unless the unit is in ``state`` (or one of them)."""
        self._state.assert_state([state] if isinstance(state, TrainingState) else list(state))

    # -- forward ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # the work is in the hooks on the wrapped module (or, for a group, on each module,
        # and calling the group itself raises)
        compiled = self.__dict__["_compiled_module"]
        if torch.compiler.is_compiling():
            # The choice between the traced path and the eager one, made where the frame
            # Dynamo traces starts, so that its guards hold it (the eager path breaks the
            # graph inside the units' hooks, and a frame compiled with that break would
            # otherwise run the break at every later call), and read by the hooks
            # (see [Note: collectives traced into the compiled graph]).
            self._state.context.choose_path()
        try:
            if compiled is not None:
                return compiled(*args, **kwargs)
            return self._fsdp_wrapped_module(*args, **kwargs)
        except BaseException:
            self._state.forward_raised()
            raise


def _after_load(unit: XlaFullyShardedDataParallel, _incompatible: Any) -> None:
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
