"""XlaFullyShardedDataParallel: ZeRO-3 sharding of an ``nn.Module`` on XLA devices.

Each unit keeps only this rank's shard of its parameters. The original parameters stay in
their modules as *full-parameter placeholders*: leaf tensors whose XLA data is swapped
between the all-gathered full value (just before the unit computes) and a one-element
dummy (right after). Autograd still sees one leaf per original parameter, so gradients
arrive per parameter; they are reduce-scattered into the shard's ``.grad`` once every
parameter of a shard group has its gradient.

Hook order in one training step:
forward: gather (and issue the prefetched units' gathers) -> module.forward -> free (if
resharding) -> hooks on outputs
backward: output hook: gather again (if resharded) -> ... -> per-parameter hook: when a
group is complete, free it and reduce-scatter its gradients -> root's final callback:
flush, free leftovers, reset state.

This file holds construction, the public API and forward; gathering and freeing are in
``full_parameters.py``, backward in ``backward.py``, units that group several modules (whose
forwards are hooked instead of wrapped) in ``module_group.py``.
"""
from __future__ import annotations

import contextlib
import functools
import math
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ._tensor_tree import cast_floating, collect_tensors
from .backward import BackwardHooks
from .collectives import Collectives
from .donation_order import pin_parameter_order
from .full_parameters import FullParameters
from .init_sharding import (ShardGroup, cast_buffers, find_parameters, group_parameters,
                            materialize_meta, shard_group)
from .module_group import (ModuleGroup, check_all_placed, check_members, place_grouping_units,
                           unplaced_message)
from .module_view import ModuleView
from .options import FsdpOptions
from .patched_linear import patch_linear_layers
from .safety import declare_sharded_gradients, install_optimizer_guard, validate_module
from .shard_layout import Dim0Layout
from .shard_metadata import original_names_and_shards, shard_metadata
from .torch_device_module import register as _register_torch_xla_device_module
from .training_state import TrainingState, TrainingStateError



_register_torch_xla_device_module()  # torch.utils.checkpoint on XLA tensors


class XlaFullyShardedDataParallel(FullParameters, BackwardHooks, nn.Module):
    """Shards ``module``'s parameters across the ranks of a sharding group (ZeRO-3).

    Drop-in for ``torch_xla.distributed.fsdp.XlaFullyShardedDataParallel``: same arguments,
    same defaults, same checkpoint format (flattened groups aside, below). Differences, each
    a fix:

    * auto-wrapped children receive every option, including ``reduce_scatter_bucket_size_mb``
      and ``coalesce_all_gather_ops`` (torch_xla drops them);
    * ``coalesce_all_gather_ops`` works in every mode, flattened included (torch_xla crashes);
    * ``reduce_scatter_bucket_size_mb > 0`` works with pinned layouts, the default (torch_xla's
      coalesced reduce-scatter aborts the process there);
    * ``get_original_names_and_sharded_parameters`` covers nested units (torch_xla repeats
      the root's parameters);
    * ``clip_grad_norm_`` reduces over the sharding groups by default (torch_xla sums over all
      replicas, which with ``sharding_groups`` counts every shard once per group);
    * parameters are padded only to what the collectives need (a multiple of the world size),
      not to ``128 * world_size`` elements, so a bias of 10 stays 10 (plus at most N-1);
    * all-gathers are native all-gathers even with ``pin_layout_in_collective_ops=True``;
    * the full parameters are never copied to the device while sharding;
    * ``flatten_parameters=True`` still gives the optimizer one tensor per unit, but each
      parameter is sharded on its own and a rank's shard interleaves its piece of every
      parameter, so each parameter is all-gathered into a buffer of its own. torch_xla
      gathers one flat buffer per unit and slices the parameters out of it, and a backward
      fusion that reads a bias from that buffer keeps the whole unit alive until backward.
      The checkpoint records these groups as ``interleaved`` (see ``shard_metadata``);
    * the step updates the shards and the optimizer state in place: torch_xla 2.9 lets XLA
      pair donated buffers with outputs by size and order, which copies every shard and
      optimizer state tensor in and out of each step (see ``donation_order``);
    * an optimizer built before wrapping, or ``xm.optimizer_step`` on sharded gradients, is
      an error at the optimizer step instead of silently wrong training.

    Parameters must be float32 (they are the master copy); ``compute_dtype`` sets the dtype
    of the gathered full parameters.
    """

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
        shard_param_on_dim_0: bool = False,
        pin_layout_in_collective_ops: bool = True,
        reduce_scatter_bucket_size_mb: Optional[int] = 0,
        coalesce_all_gather_ops: bool = False,
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
    ) -> None:
        grouping = isinstance(module, (list, tuple))
        if grouping:
            members = check_members(module, XlaFullyShardedDataParallel)
            if auto_wrap_policy is not None:
                raise ValueError("auto_wrap_policy wraps the inside of one module; it cannot be "
                                 "combined with a list of modules to group")
        else:
            validate_module(module, XlaFullyShardedDataParallel)
            members = [module]
        options = FsdpOptions.build(
            reshard_after_forward=reshard_after_forward, flatten_parameters=flatten_parameters,
            execute_sharding_on_init=execute_sharding_on_init,
            optimization_barrier_in_forward=(optimization_barrier_in_forward and
                                             not _debug_dummy_optimization_barrier_op),
            optimization_barrier_in_backward=(optimization_barrier_in_backward and
                                              not _debug_dummy_optimization_barrier_op),
            sync_on_finalization=(sync_on_finalization if mark_step_on_finalization is None
                                  else mark_step_on_finalization),
            disable_reshard_on_root=disable_reshard_on_root, compute_dtype=compute_dtype,
            buffer_dtype=buffer_dtype, fp32_reduce_scatter=fp32_reduce_scatter,
            sharding_groups=sharding_groups, sharding_rank=sharding_rank,
            sharding_world_size=sharding_world_size,
            shard_param_on_dim_0=shard_param_on_dim_0 or on_neuron,
            pin_layout_in_collective_ops=pin_layout_in_collective_ops,
            reduce_scatter_bucket_size_mb=reduce_scatter_bucket_size_mb or 0,
            coalesce_all_gather_ops=coalesce_all_gather_ops, param_init_fn=param_init_fn,
            shard_size_multiple=_shard_size_multiple,
            use_xla_patched_linear=_use_xla_patched_linear,
            debug_dummy_forward_pass=_debug_dummy_forward_pass, debug_msg=_debug_msg,
            debug_print=_debug_print, debug_dummy_all_gather_op=_debug_dummy_all_gather_op,
            debug_dummy_all_reduce_op=_debug_dummy_all_reduce_op,
            debug_dummy_reduce_scatter_op=_debug_dummy_reduce_scatter_op,
            debug_dummy_optimization_barrier_op=_debug_dummy_optimization_barrier_op)
        super().__init__()
        if auto_wrap_policy is not None:
            from .wrap import recursive_wrap
            recursive_wrap(module, auto_wrap_policy,
                           wrapper_cls=auto_wrapper_callable or XlaFullyShardedDataParallel,
                           only_wrap_children=True, **options.as_kwargs())
        self._options = options
        self.rank, self.world_size = options.rank, options.world_size
        self.sharding_groups = options.sharding_groups
        self.flatten_parameters = options.flatten_parameters
        self.compute_dtype, self.buffer_dtype = options.compute_dtype, options.buffer_dtype
        self.reshard_after_forward = self._orig_reshard_after_forward = reshard_after_forward
        self._collectives = Collectives(self.world_size, self.sharding_groups,
                                        options.pin_layout_in_collective_ops, self.rank,
                                        options.dummy_collectives)
        if options.debug_dummy_forward_pass:
            warnings.warn("_debug_dummy_forward_pass is accepted for compatibility with "
                          "torch_xla and has no effect in xla_fsdp: the real forward runs")
        self.gradient_predivide_factor = _default_predivide_factor(self.world_size)
        self.gradient_postdivide_factor = self.world_size / self.gradient_predivide_factor

        for m in members:
            materialize_meta(m, param_init_fn, XlaFullyShardedDataParallel)
            if options.use_xla_patched_linear:
                patch_linear_layers(m)
        self._fsdp_wrapped_module = ModuleGroup(members) if grouping else module
        self._members = members
        self._members_run: set = set()  # ids of the members that ran in this forward
        import torch_xla
        self.xla_device = torch_xla.device()
        self._groups: List[ShardGroup] = []
        self._shared_params: List[Tuple[str, str]] = []  # (alias, source) names of tied params
        self._param_order: List[str] = []
        self._unplaced = grouping
        if grouping:
            for m in members:
                object.__setattr__(m, "_fsdp_group_unit", self)
                m.register_forward_pre_hook(functools.partial(self._member_pre_hook, m),
                                            with_kwargs=True)
                m.register_forward_hook(functools.partial(self._member_post_hook, m))
        else:
            place_grouping_units(self, XlaFullyShardedDataParallel)
            self._shard_parameters([("", module)])

        self.training_state = TrainingState.IDLE
        self.has_full_params = False
        # per group: issued all-gathers, not yet installed
        self._gathered: Optional[List[List[torch.Tensor]]] = None
        self._gathered_versions: Tuple[tuple, ...] = ()
        self.reshard_after_backward = True
        self._reshard_after_forward_set = False
        self._forward_prefetch: List[XlaFullyShardedDataParallel] = []
        self._backward_prefetch: List[XlaFullyShardedDataParallel] = []
        self._is_root: Optional[bool] = None
        self._require_backward_grad_sync = True
        self._pre_backward_hook_has_run = False
        self._reduce_queue: List[Tuple[ShardGroup, torch.Tensor]] = []
        self._reduce_queue_bytes = 0
        install_optimizer_guard()
        declare_sharded_gradients()
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
    def sharded_params(self) -> List[nn.Parameter]:
        return [g.shard for g in self._groups]

    @property
    def params_with_grad(self) -> List[nn.Parameter]:
        """This unit's parameters (shards, and any unsharded ones) that have a gradient."""
        return [p for p in self.parameters() if p.grad is not None]

    @property
    def full_params(self) -> List[torch.Tensor]:
        return [p for g in self._groups for p in g.params]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> nn.Module:
        return self._fsdp_wrapped_module.__getitem__(key)

    def extra_repr(self) -> str:
        padded = [n for g in self._groups if isinstance(g.layout, Dim0Layout)
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
        for m in self.modules():
            if isinstance(m, XlaFullyShardedDataParallel):
                yield m

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool) -> None:
        """Gradients are divided by ``pre`` before the reduce-scatter and by ``post`` after it
        (defaults: a power of two near sqrt(N), and N / pre). A float32 reduction needs no
        headroom, so there both divisions happen after it."""
        self.assert_state(TrainingState.IDLE)
        for unit in (self.units() if recursive else [self]):
            unit.gradient_predivide_factor = pre
            unit.gradient_postdivide_factor = post

    # -- explicit control (FSDP2's names) ---------------------------------------------------
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the unit frees its full parameters after its forward (and gathers them
        again for backward). ``False`` saves one all-gather per unit and step and keeps the
        full parameters from forward to backward. Overrides ``disable_reshard_on_root``."""
        self.assert_state(TrainingState.IDLE)
        for unit in (self.units() if recurse else [self]):
            unit.reshard_after_forward = bool(reshard_after_forward)
            unit._reshard_after_forward_set = True

    def set_reshard_after_backward(self, reshard_after_backward: bool,
                                   recurse: bool = True) -> None:
        """Whether the unit frees its full parameters after its backward. ``False`` keeps
        them into the next forward, which then gathers nothing: for gradient accumulation,
        with ``True`` again before the last micro-batch. Parameters an optimizer step (or a
        load) has changed since they were gathered are gathered again, never reused."""
        self.assert_state(TrainingState.IDLE)
        for unit in (self.units() if recurse else [self]):
            unit.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(
            self, modules: Sequence["XlaFullyShardedDataParallel"]) -> None:
        """Units whose all-gathers are issued when this unit's forward starts, usually the
        unit(s) that run next. The compiler may then overlap them with this unit's compute
        instead of running them after it; the cost is holding their full parameters for
        longer. Without it, a unit's gather is tied to its inputs, i.e. to the previous
        unit's output."""
        self._forward_prefetch = self._prefetch_targets(modules, "forward")

    def set_modules_to_backward_prefetch(
            self, modules: Sequence["XlaFullyShardedDataParallel"]) -> None:
        """Units whose all-gathers are issued when this unit's backward starts, usually the
        unit(s) whose backward runs next (the ones before it in forward order)."""
        self._backward_prefetch = self._prefetch_targets(modules, "backward")

    def _prefetch_targets(self, modules: Sequence[Any], which: str
                          ) -> List["XlaFullyShardedDataParallel"]:
        modules = list(modules)
        for m in modules:
            if not isinstance(m, XlaFullyShardedDataParallel):
                raise TypeError(f"set_modules_to_{which}_prefetch takes FSDP units; got "
                                f"{type(m).__name__}, which is not wrapped in FSDP")
            if m is self:
                raise ValueError(f"set_modules_to_{which}_prefetch: a unit cannot prefetch "
                                 f"itself ({type(self.wrapped_module).__name__})")
        return modules

    def unshard(self) -> None:
        """Gathers this unit's full parameters now, in the graph being traced; its next
        forward uses them instead of gathering (then frees them if ``reshard_after_forward``).
        E.g. to start a unit's gather before unrelated work of the step."""
        self.assert_state(TrainingState.IDLE)
        self._rebuild_full_params([], self._options.optimization_barrier_in_forward)

    def reshard(self) -> None:
        """Frees this unit's full parameters (and any gather issued for it)."""
        self.assert_state(TrainingState.IDLE)
        self._free_full_params(self._groups, [], self._options.optimization_barrier_in_forward)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulates full, unreduced gradients until the first backward after the context.

        Costs the memory of full gradients for every unit; saves one reduce-scatter per
        accumulation step."""
        self._check_root_call("no_sync")
        saved = [(u, u._require_backward_grad_sync) for u in self.units()]
        for unit, _ in saved:
            unit._require_backward_grad_sync = False
        try:
            yield
        finally:
            for unit, flag in saved:
                unit._require_backward_grad_sync = flag

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0,
                        groups: Optional[List[List[int]]] = None) -> torch.Tensor:
        """Clips the gradients of all units by their total norm, as if unsharded.

        ``groups`` are the replica groups to reduce the norm over; by default the sharding
        groups, whose ranks together hold every shard exactly once."""
        self._check_root_call("clip_grad_norm_")
        groups = self.sharding_groups if groups is None else groups
        grads = [p.grad for p in self.params_with_grad]
        norm_type = float(norm_type)
        if not grads:
            return torch.tensor(0.0, device=self.xla_device)
        if norm_type == math.inf:
            local = torch.stack([g.abs().max() for g in grads]).max()
            total = self._collectives.all_reduce_max(local, groups)
        else:
            local = torch.stack([g.norm(norm_type) for g in grads]).norm(norm_type)
            total = self._collectives.all_reduce_sum(local ** norm_type, groups) ** (1.0 / norm_type)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return total

    def get_original_names_and_sharded_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        """(name in the unwrapped model, shard) for every shard of every unit in this tree."""
        return original_names_and_shards(self._named_units())

    def full_state_dict(self, rank0_only: bool = True) -> Dict[str, torch.Tensor]:
        """The unwrapped model's state dict on the CPU (see ``full_state_dict.py``)."""
        self._check_root_call("full_state_dict")
        from .full_state_dict import full_state_dict
        return full_state_dict(self, rank0_only)

    def load_full_state_dict(self, state_dict: Dict[str, torch.Tensor],
                             strict: bool = True) -> Tuple[List[str], List[str]]:
        """Loads an unwrapped model's state dict, e.g. a consolidated checkpoint, at any
        world size: each rank keeps only its shard."""
        self._check_root_call("load_full_state_dict")
        from .full_state_dict import load_full_state_dict
        return load_full_state_dict(self, state_dict, strict)

    def get_shard_metadata(self) -> Dict[str, Any]:
        """What consolidation needs, in torch_xla's format (see ``shard_metadata``)."""
        return shard_metadata(self, self._named_units())

    # -- sharding at construction ------------------------------------------------------------
    def _named_units(self) -> Iterator[Tuple[str, "XlaFullyShardedDataParallel"]]:
        for path, m in self.named_modules():
            if isinstance(m, XlaFullyShardedDataParallel):
                yield path, m

    def _place(self, member_paths: List[str]) -> None:
        """Shards a grouping unit's modules, named as in the unit that places it."""
        self._unplaced = False
        self._shard_parameters(list(zip(member_paths, self._members)))

    def _shard_parameters(self, roots: List[Tuple[str, nn.Module]]) -> None:
        opts = self._options
        found = find_parameters(roots, self)
        self._param_order = [owners[0][2] for _, owners in found]
        for index, members in enumerate(group_parameters(found, self.flatten_parameters)):
            group, shared = shard_group(
                members, index, flatten=self.flatten_parameters,
                dim0=opts.shard_param_on_dim_0, world_size=self.world_size, rank=self.rank,
                multiple=opts.shard_size_multiple, device=self.xla_device,
                compute_dtype=self.compute_dtype)
            self.register_parameter(group.shard._name, group.shard)
            self._groups.append(group)
            self._shared_params.extend(shared)
        for _, m in roots:
            cast_buffers(m, self.buffer_dtype, self.xla_device)

    # -- root and lazy init ------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self._is_root is None:
            self._is_root = True
            self.assert_state(TrainingState.IDLE)
            check_all_placed(self)
            self._backward_barrier_tensors: List[torch.Tensor] = []
            for unit in self.units():
                if unit is not self:
                    unit._is_root = False
                    unit._backward_barrier_tensors = self._backward_barrier_tensors
            if self._options.debug_print and self.rank == 0:
                print(f"root FSDP unit got {len(list(self.parameters()))} sharded parameters "
                      f"(_debug_msg: {self._options.debug_msg})")
        if (self._is_root and self._options.disable_reshard_on_root
                and not self._reshard_after_forward_set):
            self.reshard_after_forward = False

    def _check_root_call(self, what: str) -> None:
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError(
                f"{what}() must be called on the root FSDP unit, not on a nested unit "
                f"({type(self.wrapped_module).__name__}); call it on the outermost wrapper")
        self.assert_state(TrainingState.IDLE)

    def assert_state(self, state: Union[TrainingState, Sequence[TrainingState]]) -> None:
        """Raises ``TrainingStateError`` unless the unit is in ``state`` (or one of them)."""
        states = [state] if isinstance(state, TrainingState) else list(state)
        if self.training_state not in states:
            raise TrainingStateError(
                f"FSDP unit around {type(self.wrapped_module).__name__} is in state "
                f"{self.training_state.name}, expected {[s.name for s in states]}. This happens "
                f"when a nested unit is called outside its parent's forward, or when "
                f"backward runs twice over the same forward.")

    # -- forward ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self._fsdp_wrapped_module
        if isinstance(module, ModuleGroup):
            return module(*args, **kwargs)  # raises: the grouped modules are called instead
        args, kwargs = self._pre_forward(module, args, kwargs)
        return self._post_forward(module, module(*args, **kwargs))

    def _member_pre_hook(self, member: nn.Module, _module: nn.Module, args: tuple,
                         kwargs: dict) -> Tuple[tuple, dict]:
        return self._pre_forward(member, args, kwargs)

    def _member_post_hook(self, member: nn.Module, _module: nn.Module, _args: tuple,
                          outputs: Any) -> Any:
        return self._post_forward(member, outputs)

    def _pre_forward(self, member: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        if self._unplaced:
            raise ValueError(unplaced_message(self))
        self._lazy_init()
        recompute = _in_checkpoint_recompute()
        if self._is_root and not recompute:
            pin_parameter_order(self.xla_device)
        if id(member) in self._members_run:  # a new forward pass
            self._members_run.clear()
        self._members_run.add(id(member))
        if not recompute:  # a recompute happens inside this unit's backward: keep its state
            self.training_state = TrainingState.FORWARD
        opts = self._options
        if self.compute_dtype != torch.float32:
            args, kwargs = cast_floating(self.compute_dtype, (args, kwargs))
        inputs = collect_tensors((args, kwargs))
        barrier = opts.optimization_barrier_in_forward
        prefetch = [] if recompute else self._forward_prefetch
        self._rebuild_full_params(inputs if barrier else [], barrier, prefetch)
        self._register_post_backward_hooks()
        if opts.optimization_barrier_in_backward and torch.is_grad_enabled():
            for t in inputs:
                if t.requires_grad:
                    t.register_hook(self._input_grad_barrier)
        return args, kwargs

    def _post_forward(self, member: nn.Module, outputs: Any) -> Any:
        barrier = self._options.optimization_barrier_in_forward
        last = len(self._members_run) == len(self._members)
        if _in_checkpoint_recompute():
            # the recomputed activations' backward comes next and reads the full
            # parameters; it frees them as any backward does
            return self._register_pre_backward_hooks(outputs)
        if self.reshard_after_forward and last:
            deps = collect_tensors(outputs) if barrier else []
            self._free_full_params(self._groups, deps, barrier)
        outputs = self._register_pre_backward_hooks(outputs)
        self.training_state = TrainingState.IDLE
        return outputs


def _default_predivide_factor(world_size: int) -> float:
    """The largest power of two that divides ``world_size`` and is at most its square root:
    dividing by it before the reduction keeps low-precision sums in range."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)


def _in_checkpoint_recompute() -> bool:
    """Whether this forward recomputes activations during backward: activation
    checkpointing around the unit (``torch.utils.checkpoint``, reentrant or not, or
    torch_xla's), which runs the unit's forward again from inside the autograd engine."""
    from torch_xla.utils.checkpoint import chkpt_status
    return bool(chkpt_status.in_chkpt_bwd) or torch._C._current_graph_task_id() != -1
