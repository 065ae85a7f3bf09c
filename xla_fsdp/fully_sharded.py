"""XlaFullyShardedDataParallel: ZeRO-3 sharding of an ``nn.Module`` on XLA devices.

Each unit keeps only this rank's shard of its parameters. The original parameters stay in
their modules as *full-parameter placeholders* (``_unit.param_record``): leaf tensors that
hold the all-gathered full value while the unit computes and an empty dummy otherwise.
Autograd still sees one leaf per original parameter, so gradients arrive per parameter; they
are reduce-scattered into the shard's ``.grad`` once every parameter of a shard group has its
gradient.

This module is the public class: construction and the methods users call. The work is in
the layers below it (see ARCHITECTURE.md): ``_init`` (finding and grouping parameters),
``_unit`` (one state object per unit, owning its hooks, and its ``UnitParams``, owning
its shard groups), ``_sharding`` (layouts and collectives) and ``checkpoint`` (state dicts
and shard metadata).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ._init.compiled_module import split_compiled
from ._init.find_parameters import find_parameters
from ._init.mixed_precision import float32_modules, float32_statistics, run_in_float32
from ._init.shard_members import ShardedParameters, shard_members
from ._init.module_group import ModuleGroup, check_members, mark_grouped
from ._init.validate import validate_first_forward, validate_group_arguments, validate_module
from ._unit.buffers import place_buffers
from ._unit.module_view import ModuleView
from ._unit.options import FsdpOptions
from ._unit.param_record import Owner
from ._unit.training_state import TrainingState
from ._unit.unit_hooks import HookedUnitState
from ._unit.unit_params import UnitParams
from .unit_module import UnitModule
from .wrap import recursive_wrap


# the constructor's arguments that are not options (what to wrap, and how to wrap inside it),
# and the names Python adds to its locals()
_NOT_OPTIONS = ("self", "__class__", "module", "auto_wrap_policy", "auto_wrapper_callable")


class XlaFullyShardedDataParallel(UnitModule):
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
      group writes checkpoints. Without it each group holds a different part of one model
      (a model-parallel slice), as torch_xla means it: each writes its own checkpoint
      files, and ``clip_grad_norm_`` sums over every rank;
    * BatchNorm computes in float32 under a low-precision ``compute_dtype``, and buffers
      keep their dtype unless ``buffer_dtype`` is given (torch_xla casts them to the
      compute dtype);
    * under a low-precision ``compute_dtype`` attention's matmuls run in it too (torch's
      ``scaled_dot_product_attention`` would cast them to float32; see [Note: attention
      under a low-precision compute_dtype] in ``_unit/attention.py``), and in
      every unit sdpa on XLA keeps no probabilities for backward: it computes them again
      there (see [Note: attention inside a unit keeps no probabilities]);
    * ``zero_missing_gradients=True`` keeps ranks' reductions identical when their data
      leave different parameters of a unit without a gradient;
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
      The checkpoint records these groups as ``interleaved`` (see ``checkpoint.formats.per_rank``);
    * the step updates the shards and the optimizer state in place: torch_xla 2.9 lets XLA
      pair donated buffers with outputs by size and order, which copies every shard and
      optimizer state tensor in and out of each step (see ``donation_order``);
    * an optimizer built before wrapping, or ``xm.optimizer_step`` on sharded gradients, is
      an error at the optimizer step instead of silently wrong training;
    * ``.to()``, ``.half()``, ``.cpu()`` and the like never replace a shard: moving an
      offloaded model to its device keeps its host shards, other moves and casts are
      refused (see [Note: converting a wrapped model] in ``_unit/conversions.py``);
    * ``vocab_parallel=True`` (not in torch_xla) keeps vocabulary tables (``nn.Embedding``
      weights, and ``nn.Linear`` weights shaped like one, the LM head) in row
      blocks that are never gathered: lookups and logits are computed on each rank's rows
      for every rank's tokens, as FSDPv2's partitioner does, so no rank holds a whole
      table (see [Note: vocabulary-parallel tables] in ``_sharding/vocab_parallel.py``).
      Every rank's batch must have the same shape;
    * ``offload_optimizer=True`` (not in torch_xla) keeps each rank's shards, their
      gradients and so the optimizer's state on the host, where the optimizer steps; the
      device holds a compute-dtype copy of each shard (see [Note: the optimizer on the
      host] in ``_unit/host_offload.py``). Clip with this model's ``clip_grad_norm_``.

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
        vocab_parallel: bool = False,
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
            validate_module(module)
            members = [module]
        options = FsdpOptions.from_arguments(arguments)
        if auto_wrap_policy is not None:
            recursive_wrap(module, auto_wrap_policy,
                           wrapper_cls=auto_wrapper_callable or XlaFullyShardedDataParallel,
                           only_wrap_children=True, **options.as_arguments())
        super().__init__(members, ModuleGroup(members) if grouping else module, options,
                         "+".join(type(m).__name__ for m in members), detached=grouping,
                         compile_refusal=None)
        # called instead of the wrapped module, not registered: its parameters are the
        # wrapped module's (see [Note: FSDP's hooks under torch.compile])
        self.__dict__["_compiled_module"] = compiled
        self.unit_state.hook_members([compiled] if compiled is not None else [])
        if grouping:
            mark_grouped(members, self)

    @property
    def module(self) -> nn.Module:
        """The wrapped module as torch_xla's ``unit.module`` presents it (see
        ``module_view``): attributes and calls reach the wrapped module, and
        ``unit.module.module`` is the wrapped module itself."""
        view = self.__dict__.get("_module_view")
        if view is None:
            view = self.__dict__["_module_view"] = ModuleView(self.wrapped_module, self)
        return view

    def _fall_through_to(self) -> Sequence[Any]:
        return (self.wrapped_module,)  # code written for the module reads it off the unit

    def __getitem__(self, key: int) -> nn.Module:
        return self.wrapped_module.__getitem__(key)

    def unshard(self) -> None:
        """Gathers this unit's full parameters now, in the graph being traced; its next
        forward uses them instead of gathering (then frees them if ``reshard_after_forward``).
        E.g. to start a unit's gather before unrelated work of the step."""
        self.assert_state(TrainingState.IDLE)
        self.unit_state.params.unshard([], self.options.optimization_barrier_in_forward)

    # -- the unit's schedule: torch_xla's attributes, FSDP2's setters --------------------------
    # A ScannedLayers stack schedules its own layers (one gathered at a time inside its scan,
    # see ``scan.loop``): these controls are this class's, and recursion skips a stack.
    @property
    def reshard_after_forward(self) -> bool:
        return self.unit_state.params.reshard_after_forward

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool) -> None:
        self.unit_state.params.set_reshard_after_forward(value)

    @property
    def reshard_after_backward(self) -> bool:
        return self.unit_state.params.reshard_after_backward

    def _scheduled(self, recurse: bool) -> List["XlaFullyShardedDataParallel"]:
        return [u for u in self.units() if isinstance(u, XlaFullyShardedDataParallel)] \
            if recurse else [self]

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the unit frees its full parameters after its forward (and gathers them
        again for backward). ``False`` saves one all-gather per unit and step and keeps the
        full parameters from forward to backward. Overrides ``disable_reshard_on_root``."""
        self.assert_state(TrainingState.IDLE)
        for unit in self._scheduled(recurse):
            unit.unit_state.params.set_reshard_after_forward(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool,
                                   recurse: bool = True) -> None:
        """Whether the unit frees its full parameters after its backward. ``False`` keeps
        them into the next forward, which then gathers nothing: for gradient accumulation,
        with ``True`` again before the last micro-batch. Parameters an optimizer step (or a
        load) has changed since they were gathered are gathered again, never reused."""
        self.assert_state(TrainingState.IDLE)
        for unit in self._scheduled(recurse):
            unit.unit_state.params.set_reshard_after_backward(bool(reshard_after_backward))

    def set_modules_to_forward_prefetch(
            self, modules: Sequence["XlaFullyShardedDataParallel"]) -> None:
        """Units whose all-gathers are issued when this unit's forward starts, usually the
        unit(s) that run next. The compiler may then overlap them with this unit's compute
        instead of running them after it; the cost is holding their full parameters for
        longer. Without it, a unit's gather is tied to its inputs, i.e. to the previous
        unit's output."""
        self.unit_state.set_prefetch(forward=self._prefetch_targets(modules, "forward"))

    def set_modules_to_backward_prefetch(
            self, modules: Sequence["XlaFullyShardedDataParallel"]) -> None:
        """Units whose all-gathers are issued when this unit's backward starts, usually the
        unit(s) whose backward runs next (the ones before it in forward order)."""
        self.unit_state.set_prefetch(backward=self._prefetch_targets(modules, "backward"))

    def _prefetch_targets(self, modules: Sequence[Any], which: str
                          ) -> List[HookedUnitState]:
        modules = list(modules)
        for m in modules:
            if isinstance(m, UnitModule) and not isinstance(m, XlaFullyShardedDataParallel):
                raise TypeError(f"set_modules_to_{which}_prefetch: {type(m).__name__} gathers "
                                f"one layer at a time inside its scan, never as a whole; "
                                f"give it prefetch_next_layer=True to gather each layer "
                                f"beside the previous one's compute")
            if not isinstance(m, UnitModule):
                raise TypeError(f"set_modules_to_{which}_prefetch takes FSDP units; got "
                                f"{type(m).__name__}, which is not wrapped in FSDP")
            if m is self:
                raise ValueError(f"set_modules_to_{which}_prefetch: a unit cannot prefetch "
                                 f"itself ({type(self.wrapped_module).__name__})")
        return [m.unit_state for m in modules]

    def reshard(self) -> None:
        """Frees this unit's full parameters (and any gather issued for it)."""
        self.assert_state(TrainingState.IDLE)
        params = self.unit_state.params
        params.reshard(params.gathered, [], self.options.optimization_barrier_in_forward)

    # -- sharding at construction ------------------------------------------------------------
    def _new_state(self, name: str, members: List[nn.Module], params: UnitParams,
                   detached: bool, compile_refusal: Optional[str]) -> HookedUnitState:
        return HookedUnitState(self, name, members, params, self.options, detached,
                               first_forward_check=validate_first_forward,
                               compile_refusal=compile_refusal)

    def _shard_members(self, roots: List[Tuple[str, nn.Module]]) -> ShardedParameters:
        """Each parameter below ``roots`` on its own, or with ``flatten_parameters`` a unit's
        parameters of one dtype together; buffers placed on the device."""
        found = find_parameters(roots, self)
        modules = [m for _, root in roots for m in root.modules()]
        fp32 = float32_modules(modules, self.compute_dtype)

        def dtype_of(owners: List[Owner]) -> torch.dtype:
            return torch.float32 if any(id(m) in fp32 for m, _ in owners) else self.compute_dtype

        sharded = shard_members([found], False, self.options, self.xla_device,
                                self.unit_state.name, dtype_of)
        for m in modules:
            if id(m) in fp32:
                run_in_float32(m, self.compute_dtype)
        kept = float32_statistics(modules)
        for _, m in roots:
            place_buffers(m, self.buffer_dtype, self.xla_device, keep=kept)
        return sharded

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
            self.unit_state.context.choose_path()
        try:
            with _without_inference_mode():
                if compiled is not None:
                    return compiled(*args, **kwargs)
                return self.wrapped_module(*args, **kwargs)
        except BaseException:
            self.unit_state.forward_raised()
            raise


def _without_inference_mode() -> Any:
    """[Note: a forward under inference_mode]
    torch_xla 2.9 cannot run a module under ``torch.inference_mode()``: any view of an
    ordinary XLA tensor there (a weight's transpose in ``nn.Linear``) fails with "Cannot set
    version_counter for inference tensor", unwrapped or not; and a placeholder cannot take
    an inference tensor as its data. Hugging Face's pipelines run their forward under it. A
    unit's forward therefore runs with inference mode off and gradients off, as under
    ``torch.no_grad()``: the same values, ordinary tensors out."""
    # Dynamo cannot trace the question, and a compiled graph answers it itself
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def options_from_keywords(keywords: Dict[str, Any], owner: str) -> FsdpOptions:
    """The options that ``XlaFullyShardedDataParallel(module, **keywords)`` would take, for a
    unit of another kind (``owner``, named in the error) that accepts the same keywords."""
    unknown = sorted(set(keywords) - set(_OPTION_DEFAULTS))
    if unknown:
        raise TypeError(f"{owner} got unexpected keyword arguments {unknown}; it takes "
                        f"XlaFullyShardedDataParallel's options")
    return FsdpOptions.from_arguments({**_OPTION_DEFAULTS, **keywords})


# read once, before anything (the TPU planner's switches) can replace the constructor
_OPTION_DEFAULTS = {n: p.default for n, p in
                    inspect.signature(XlaFullyShardedDataParallel.__init__).parameters.items()
                    if n not in _NOT_OPTIONS}
