"""Every use of torch's and torch_xla's private (underscore) APIs, and of the client libraries'
(transformers'), in one place.

Nothing here is promised by any of those projects, so each use sits behind a named function
that says what it is for, and an upgrade has one file to check. Checked against torch 2.9.0,
torch_xla 2.9.0 and transformers 4.57 and 5. (The virtual-device launcher, ``launch.virtual``,
patches torch_xla's internals of its own and is not routed through here. The names a file
format stores, torch.save's rebuild functions and DCP's metadata classes, are the format's,
not uses: the restricted unpicklers that admit them by name keep them with their readers.)

torch_xla is imported inside the functions, so that importing this module stays cheap.
"""
from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree

from .._sharding.tensor_tree import copy_tree


def _xlac() -> Any:
    import torch_xla
    return torch_xla._XLAC


def _replace_once(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """``owner.name`` becomes ``make(original)``, once per process."""
    original = getattr(owner, name)
    if getattr(original, "xla_fsdp_replaced", False):
        return
    replacement = make(original)
    replacement.xla_fsdp_replaced = True  # type: ignore[attr-defined]
    setattr(owner, name, replacement)


# -- torch.distributed.checkpoint -------------------------------------------------------------
def dcp_file_prefix(prefix: str) -> Any:
    """The storage data of a save plan that makes ``FileSystemWriter`` name its files
    ``{prefix}{n}.distcp`` (see [Note: naming DCP's files])."""
    from torch.distributed.checkpoint.filesystem import _StoragePrefix
    return _StoragePrefix(prefix)


def dcp_plan_prefix(plan: Any) -> str:
    """The file-name prefix a save plan's storage data (``dcp_file_prefix``) holds."""
    return plan.storage_data.prefix


def dcp_stored_at(info: Any) -> Tuple[str, int, int]:
    """(file, offset, length) of one stored item: ``FileSystemWriter``'s record of it (the
    values of a DCP ``Metadata``'s ``storage_data``, and a ``WriteResult``'s)."""
    return info.relative_path, info.offset, info.length


# -- autograd -------------------------------------------------------------------------------
def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Runs ``fn`` when the current backward pass ends (what FSDP finishes a backward with)."""
    Variable._execution_engine.queue_callback(fn)


def before_grad_scaler_reads(then: Callable[[Any], None]) -> None:
    """``then(optimizer)`` runs each time ``torch.amp.GradScaler.step`` is about to read an
    optimizer's inf flags on the host to decide whether it steps (not for an optimizer that
    takes the flags itself, ``_step_supports_amp_scaling``). Once per process."""
    def make(original: Callable) -> Callable:
        def decide(self: Any, optimizer: Any, optimizer_state: Any, *args: Any,
                   **kwargs: Any) -> Any:
            then(optimizer)
            return original(self, optimizer, optimizer_state, *args, **kwargs)
        return decide
    _replace_once(torch.amp.GradScaler, "_maybe_opt_step", make)


def after_grad_scaler_unscale(then: Callable[[Any, Dict[torch.device, torch.Tensor]], None]
                              ) -> None:
    """``then(optimizer, found_inf_per_device)`` runs each time ``torch.amp.GradScaler`` has
    unscaled an optimizer's gradients, before anything reads its inf flags (its step's
    decision, its scale's update). Once per process."""
    def make(original: Callable) -> Callable:
        def unscale(self: Any, optimizer: Any, inv_scale: torch.Tensor,
                    found_inf: torch.Tensor, allow_fp16: bool) -> Dict[torch.device, torch.Tensor]:
            found = original(self, optimizer, inv_scale, found_inf, allow_fp16)
            then(optimizer, found)
            return found
        return unscale
    _replace_once(torch.amp.GradScaler, "_unscale_grads_", make)


def incompatible_keys(missing: List[str], unexpected: List[str]) -> Any:
    """What ``nn.Module.load_state_dict`` returns: its named tuple of the keys that did not
    match."""
    from torch.nn.modules.module import _IncompatibleKeys
    return _IncompatibleKeys(missing, unexpected)


def post_accumulate_grad_hooks(t: torch.Tensor) -> List[Callable[[torch.Tensor], None]]:
    """The hooks registered on ``t`` with ``register_post_accumulate_grad_hook``."""
    hooks = getattr(t, "_post_accumulate_grad_hooks", None)
    return list(hooks.values()) if hooks else []


def in_backward() -> bool:
    """Whether this code runs inside the autograd engine (e.g. a forward recomputed by
    activation checkpointing during backward)."""
    return torch._C._current_graph_task_id() != -1


def preserve_version_counter(tensors: Sequence[torch.Tensor]
                             ) -> contextlib.AbstractContextManager:
    """Keeps the tensors' version counters across ``.data`` swaps, so that autograd does not
    take a swap for an in-place update of a tensor it saved. One context for many tensors:
    its cost is per call, not per tensor."""
    return torch.autograd._unsafe_preserve_version_counter(tuple(tensors))


def call_as_tensor(func: Callable, args: Sequence[Any], kwargs: Optional[Dict]) -> Any:
    """``func`` with tensor subclasses' ``__torch_function__`` off, as on plain tensors."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


def dynamo_is_tracing() -> bool:
    """Inside Dynamo: traced code, or Dynamo's own inspection of the real tensors it wraps
    (where ``torch.compiler.is_compiling()`` is False)."""
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None


def version(t: torch.Tensor) -> int:
    """``t``'s version counter: bumped by every in-place write through autograd."""
    return t._version


# -- torch-function modes -------------------------------------------------------------------
def innermost_function_mode() -> Optional[Any]:
    """The torch-function mode on top of this thread's stack (the first to see a call), or
    None."""
    from torch.overrides import _get_current_function_mode_stack
    stack = _get_current_function_mode_stack()
    return stack[-1] if stack else None


# -- modules ----------------------------------------------------------------------------------
def children(m: nn.Module) -> Dict[str, nn.Module]:
    """``m``'s registered children under every name, duplicates included
    (``named_children()`` yields a module registered twice once)."""
    return {name: child for name, child in m._modules.items() if child is not None}


def module_hook_count(m: nn.Module) -> int:
    """How many forward, forward-pre, backward and backward-pre hooks ``m`` has of its own."""
    return (len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
            + len(m._backward_pre_hooks))


def is_persistent_buffer(m: nn.Module, name: str) -> bool:
    """Whether ``m``'s own buffer ``name`` goes into ``state_dict()``."""
    return name not in m._non_persistent_buffers_set


@contextlib.contextmanager
def parameters_replaced(replacements: Dict[nn.Module, Dict[str, torch.Tensor]]
                        ) -> Iterator[None]:
    """For the block, each module's registered parameters are ``replacements[module]`` (what
    code that walks ``_parameters`` itself sees, as Hugging Face's ``get_parameter_names``
    does); then its own again, the same dict in its order."""
    saved = [(m, m._parameters) for m in replacements]
    try:
        for m, params in replacements.items():
            m.__dict__["_parameters"] = dict(params)
        yield
    finally:
        for m, params in saved:
            m.__dict__["_parameters"] = params


def op_schema(target: Any) -> Optional[Any]:
    """The schema of an aten op overload (what it writes, what its outputs alias), or None
    for any other callable in a traced graph."""
    return getattr(target, "_schema", None)


def check_before_conversion(check: Callable[[nn.Module, Callable], None]) -> None:
    """Makes every module's conversion (``Module._apply``: ``to``, ``half``, ``cpu``...) call
    ``check(module, fn)`` before converting that module, once per process."""
    def make(original: Callable) -> Callable:
        def _apply(self: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
            check(self, fn)
            return original(self, fn, recurse)
        return _apply
    _replace_once(nn.Module, "_apply", make)


def is_batch_norm(m: nn.Module) -> bool:
    """BatchNorm of any dimension, lazy and synchronised ones included."""
    return isinstance(m, _BatchNorm)


def register_device_module(name: str, module: ModuleType) -> None:
    """Makes ``module`` ``torch.<name>``, where ``torch.utils.checkpoint`` looks up a
    device's RNG state."""
    torch._register_device_module(name, module)


def script_as(fn: Callable, op: str) -> None:
    """TorchScript compiles calls of ``fn`` (a wrapper of a torch function) as the aten
    operator ``op``, as it compiles the function ``fn`` wraps."""
    from torch.jit._builtins import _register_builtin
    _register_builtin(fn, op)


def tree_flatten(tree: Any) -> Tuple[List[Any], Any]:
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: List[Any], spec: Any) -> Any:
    return _pytree.tree_unflatten(leaves, spec)


def decompositions(ops: List[Any]) -> Dict[Any, Callable]:
    """PyTorch's own decompositions of ``ops``, for tracing."""
    from torch._decomp import get_decompositions
    return get_decompositions(ops)


def dropout_decomposed_when_compiled() -> None:
    """[Note: dropout under torch.compile] Traced, ``nn.Dropout`` and ``F.dropout`` become
    ``aten.native_dropout``, whose XLA kernel in torch_xla 2.9 scales the kept values by
    1/p instead of 1/(1 - p) (see [Note: dropout in a scanned layer]): every step compiled
    with torch_xla's backend (``openxla``) that drops out trains on values 2.3x too large
    at p = 0.3, with or without FSDP. That backend is torch's ``aot_autograd`` with no
    decompositions of its own; PyTorch's decompositions of dropout and its backward (a
    Bernoulli draw and a boolean mask) are added to it, so a compiled step drops out as
    the eager one does. Installed with FSDP's process-wide effects."""
    from torch._dynamo.backends import torchxla
    aten = torch.ops.aten
    table = dict(torchxla.openxla.kwargs.get("decompositions") or {})
    table.update(decompositions([aten.native_dropout, aten.native_dropout_backward]))
    torchxla.openxla.kwargs["decompositions"] = table


def foreach_zero_counts_as_a_write() -> None:
    """[Note: zeroing gradients with foreach kernels] An optimizer's ``zero_grad(set_to_none=
    False)`` zeroes the gradients with ``torch._foreach_zero_`` (its default on XLA), whose
    torch_xla 2.9 kernel does not bump the version counters of XLA tensors as every other
    in-place write does (on the CPU it does). FSDP tells a dropped ``no_sync`` accumulation
    by the counter of the gradient it left (``ShardGroup.accumulating``): a zeroing it did
    not see brought the dropped micro-batches back into the next synchronised step,
    silently. ``torch._foreach_zero_`` is wrapped once per process to bump the counter of
    each XLA tensor whose counter the kernel left unchanged, so the wrapper does nothing
    once torch_xla counts the write itself. Installed with FSDP's process-wide effects."""
    def make(original: Callable) -> Callable:
        def zero_(tensors: Sequence[torch.Tensor]) -> None:
            tensors = list(tensors)
            xla = [(t, t._version) for t in tensors if t.device.type == "xla"]
            original(tensors)
            unseen = [t for t, seen in xla if t._version == seen]
            if unseen:
                torch.autograd.graph.increment_version(unseen)
        return zero_
    _replace_once(torch, "_foreach_zero_", make)


# -- the torch.save format ------------------------------------------------------------------
def file_writer(path: str) -> Any:
    """The zip writer ``torch.save`` uses: one record at a time."""
    return torch._C.PyTorchFileWriter(path)


def rebuild_tensor() -> Callable:
    """The function a ``torch.save`` pickle calls to rebuild a tensor from its storage."""
    return torch._utils._rebuild_tensor_v2


def storage_type_names() -> Dict[torch.dtype, str]:
    """dtype -> the name of its typed storage class, as ``torch.save`` pickles it."""
    return torch.storage._dtype_to_storage_type_map()


# -- torch_xla ------------------------------------------------------------------------------
def wrap_overrides(module: nn.Module) -> Dict[str, Any]:
    """The wrapper options a module asks auto-wrap for over the policy's (the attribute
    fairscale's and torch_xla's ``wrap`` set and read)."""
    return getattr(module, "_wrap_overrides", None) or {}


def to_cpu(tree: Any) -> Any:
    """``tree`` with its XLA tensors copied to the CPU in one transfer, as ``xm.save`` does,
    and its containers of the types they were: torch_xla's own walk rebuilds every tuple as a
    list and every dict subclass as a dict, so an optimizer's ``betas`` came back from a
    checkpoint as a list. A tensor held twice is copied once."""
    on_device: Dict[int, torch.Tensor] = {}
    copy_tree(lambda t: on_device.setdefault(id(t), t) if t.device.type == "xla" else t, tree)
    if not on_device:
        return copy_tree(lambda t: t, tree)
    tensors = list(on_device.values())
    _xlac()._xla_sync_multi(tensors, devices=[], wait=True, sync_xla_data=False)
    copies = dict(zip(on_device, _xlac()._xla_get_cpu_tensors(tensors), strict=True))
    return copy_tree(lambda t: copies.get(id(t), t), tree)


def scan_flat(body: Callable, init: List[torch.Tensor], xs: List[torch.Tensor],
              reverse: bool) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """torch_xla's lowering of a scan to an XLA while loop, without its AOTAutograd wrapper:
    ``body(carry, xs slice) -> (carry, ys slice)`` traced once."""
    from torch_xla.experimental.scan import _scan_impl_flat
    return _scan_impl_flat(body, init, xs, reverse=reverse)


@contextlib.contextmanager
def fresh_collective_token() -> Iterator[None]:
    """Traces the body with a collective token of its own and puts the device's back after
    (see [Note: the collective token inside a loop body] in ``scan.loop``)."""
    import torch_xla.core.xla_model as xm
    device = xm._get_device_context().device
    outer = _xlac()._get_all_reduce_token(device)
    _xlac()._set_all_reduce_token(device, None)
    try:
        yield
    finally:
        _xlac()._set_all_reduce_token(device, outer)


def collective_token_added() -> bool:
    """Whether the collectives torch_xla lowers in this process add its collective token to
    their input (see [Note: no collective token on a TPU] in ``_sharding.collectives``).
    Lowers, never runs, one reduce-scatter under a token of its own to see. torch_xla reads
    its switch when it lowers its first collective, so this also settles the switch."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    xlac = torch_xla._XLAC
    with fresh_collective_token():
        token, _ = xm._get_all_reduce_token()
        probe = torch.zeros(2, device=torch_xla.device())
        reduced, _ = xlac._xla_reduce_scatter(xm.REDUCE_SUM, probe, token, 1.0, 0, 1, [], True,
                                              None, None)
        hlo = xlac._get_xla_tensors_hlo([reduced])
    return " add(" in hlo[hlo.index("\nENTRY"):]


def run_pending(tensors: Sequence[Optional[torch.Tensor]]) -> None:
    """Executes the pending graph of ``tensors`` now, as its own computation, and restarts
    the device's collective token after it (see [Note: FSDP's hooks under torch.compile]).

    The token chains every collective after the previous one; a sync of some tensors (unlike
    ``torch_xla.sync()``) leaves the token pointing at the graph just run, whose input
    buffers XLA may since have donated, so the next collective would read a deleted buffer.
    The caller's collectives must therefore be the last ones issued on the device."""
    import torch_xla.core.xla_model as xm
    tensors = [t for t in tensors if t is not None and t.device.type == "xla"]
    if tensors:
        xm.unlazy(tensors)
        _xlac()._set_all_reduce_token(str(tensors[0].device), None)


@contextlib.contextmanager
def off_token_chain(device: torch.device) -> Iterator[None]:
    """The collectives issued inside read the device's collective token as it was before
    them and leave it so: none of them waits on another (see [Note: collectives off the
    token chain] in ``_sharding.collectives``). Only the token's value is swapped, never a
    buffer: replacing a token that holds a finished step's data can wait on the device while
    holding the GIL, which is why the token found is the one put back."""
    xlac = _xlac()
    key = str(device)
    base = xlac._get_all_reduce_token(key)
    try:
        yield
    finally:
        xlac._set_all_reduce_token(key, base)


def pinned_all_gathers(shards: Sequence[torch.Tensor], shard_count: int,
                       rank_groups: Optional[List[List[int]]],
                       chained: bool) -> List[torch.Tensor]:
    """One native all-gather along dim 0 per shard, layout pinned: the collectives
    ``xm.all_gather(shard, output=buffer, pin_layout=True)`` issues. ``chained``: each waits
    on the one before it through the device's collective token, as torch_xla chains them;
    otherwise each reads the token as found and none is chained on another (see [Note:
    collectives off the token chain] in ``_sharding.collectives``). Without its per-call
    Python: it compares the output buffer with ``None`` twice, and a tensor compared with
    ``None`` raises and catches a TypeError inside torch (32 us each under cProfile, twice per
    parameter per gather). See [Note: per-step host cost]."""
    import torch_xla.core.xla_model as xm
    xlac = _xlac()
    token, context = xm._get_all_reduce_token()
    outputs = []
    for shard in shards:
        out = shard.new_empty((shard.shape[0] * shard_count,) + tuple(shard.shape[1:]))
        new_token = xlac._xla_all_gather_out(out, shard, token, 0, shard_count,
                                             rank_groups or [], True)
        if chained:
            token = new_token
        outputs.append(out)
    if chained:
        xlac._set_all_reduce_token(context.device, token)
    return outputs


class CollectiveBindings:
    """What ``_sharding.collectives.Collectives`` is given of torch_xla's bindings (that
    layer may not import them)."""
    pinned_all_gathers = staticmethod(pinned_all_gathers)
    off_token_chain = staticmethod(off_token_chain)
    collective_token_added = staticmethod(collective_token_added)


def multiply_in_place(tensors: List[torch.Tensor], value: float) -> None:
    """``t.mul_(value)`` for every tensor, as one foreach call (one dispatch, not one per
    tensor through torch's Python meta checks)."""
    torch._foreach_mul_(tensors, value)


def multiplied(tensors: List[torch.Tensor], value: float) -> List[torch.Tensor]:
    """``t * value`` for every tensor, as one foreach call (see ``multiply_in_place``)."""
    return list(torch._foreach_mul(tensors, value))


# -- torch.compile --------------------------------------------------------------------------
def compiled_inner(module: nn.Module) -> Optional[nn.Module]:
    """The module ``torch.compile`` compiled, if ``module`` is what it returned."""
    from torch._dynamo.eval_frame import OptimizedModule
    return module._orig_mod if isinstance(module, OptimizedModule) else None


def functional_all_gather(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, as an op Dynamo traces into a graph
    (torch's functional collective; torch_xla lowers it to XLA's all-gather over all ranks)."""
    out = torch.ops._c10d_functional.all_gather_into_tensor(tensor, world, "")
    return torch.ops._c10d_functional.wait_tensor(out)


def functional_reduce_scatter(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """The sum over all ranks of ``tensor``, this rank's dim-0 block of it, as an op Dynamo
    traces into a graph."""
    out = torch.ops._c10d_functional.reduce_scatter_tensor(tensor, "sum", world, "")
    return torch.ops._c10d_functional.wait_tensor(out)


def run_at_trace(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` as Dynamo runs it: once while it traces, its result a constant of the graph."""
    return torch._dynamo.assume_constant_result(fn)


def run_single_process(fn: Callable[[], Any]) -> Any:
    """torch_xla's launcher for one device of an accelerator, in this process."""
    from torch_xla._internal import pjrt
    return pjrt._run_singleprocess(fn)


def run_multiprocess(fn: Callable[[], Any]) -> Dict[int, Any]:
    """torch_xla's launcher for every local device of an accelerator, a process each."""
    from torch_xla._internal import pjrt
    return pjrt.run_multiprocess(fn)


# -- transformers -----------------------------------------------------------------------------
def tied_weights_patterns(module: nn.Module) -> List[str]:
    """The patterns of the parameters a transformers model class ties in ``module`` (its own,
    not its children's)."""
    return list(getattr(module, "_tied_weights_keys", None) or [])


def wrap_trainer_method(trainer: type, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replaces Trainer's private method ``name`` (``_wrap_model``,
    ``_load_optimizer_and_scheduler``) with ``wrap`` of it (the Notes in compat/hf_trainer)."""
    setattr(trainer, name, wrap(getattr(trainer, name)))


# -- tracing without executing (xla_fsdp.aot) --------------------------------------------------
def placeholder(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An XLA tensor of ``shape`` and ``dtype`` that holds no device memory: a graph that
    uses it takes it as a parameter; reading its value aborts the process."""
    from torch_xla.core.xla_builder import create_placeholder_tensor
    return create_placeholder_tensor(tuple(shape), dtype)


def xla_tensor_id(t: torch.Tensor) -> int:
    """The id of the lazy tensor behind ``t`` now (an in-place update through
    functionalization gives it a new one)."""
    return _xlac()._xla_get_tensor_id(t)


def pending_tensor_count(device: str) -> int:
    """How many live tensors on ``device`` have a pending graph for a value: what the next
    ``torch_xla.sync()`` computes."""
    return sum(_xlac()._check_device_tensor_need_materialization(device))


def run_live_graphs(device: torch.device) -> None:
    """Runs the pending graph of every live tensor on ``device``, as ``torch_xla.sync()``
    does, without ending the step: the device's random seed is not advanced and no step
    closure runs, so what the step draws and logs is what it would be without this. The
    collective token restarts after it, as after ``torch_xla.sync()`` (see ``run_pending``:
    every collective of the device has run)."""
    _xlac()._xla_sync_live_tensors(str(device), [], False)
    _xlac()._set_all_reduce_token(str(device), None)


def pending_ir(tensors: Sequence[torch.Tensor]) -> str:
    """torch_xla's text of the pending graph computing ``tensors`` (cheaper than its HLO)."""
    return _xlac()._get_xla_tensors_text(list(tensors))


def needs_computation(tensors: Sequence[torch.Tensor]) -> List[bool]:
    """For each tensor, whether its value is a pending graph (not device data)."""
    return list(_xlac()._check_tensor_need_materialization(list(tensors)))


def graph_hlo(outputs: Sequence[torch.Tensor]) -> str:
    """The HLO text of the graph computing ``outputs``, as torch_xla lowers it to compile
    (without the donations, which torch_xla decides at compile time)."""
    return _xlac()._get_xla_tensors_hlo(list(outputs))


def graph_hash(outputs: Sequence[torch.Tensor]) -> bytes:
    """torch_xla's hash of the graph computing ``outputs``: equal hashes are the same
    computation (torch_xla reuses a compiled program by it)."""
    return _xlac()._get_graph_hash(list(outputs))


def graph_inputs(outputs: Sequence[torch.Tensor]) -> Tuple[List[int], List[torch.Tensor]]:
    """The device data the graph computing ``outputs`` reads, in parameter order: for each,
    the id of the lazy tensor that held it when the graph first used it, and a tensor
    holding it."""
    ids, tensors = _xlac()._get_tensors_xla_device_data_node(list(outputs), [])
    return list(ids), list(tensors)


def cut_pending_graphs(device: str) -> None:
    """Every live tensor on ``device`` whose value is a pending graph gets a placeholder
    instead: the graph is dropped unrun, and later graphs take the tensor as a parameter,
    as they would after ``torch_xla.sync()`` had run it."""
    _xlac()._clear_pending_irs(device)


def pretend_world(world_size: Optional[int], rank: Optional[int]) -> None:
    """Makes torch_xla's runtime answer ``world_size`` and ``rank`` for this process, so
    that one traced rank builds the graphs rank ``rank`` of that world would (None, None:
    its own answers again)."""
    import torch_xla.runtime as xr
    xr._WORLD_SIZE = world_size
    xr._ORDINAL = rank


def view_base(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor ``t`` is a view of, if any."""
    return t._base


def alias_id(t: torch.Tensor) -> int:
    """The lazy tensor id whose buffer ``t``'s pending value replaces: torch_xla donates an
    input to a sync's program when the input was read under this id."""
    import re

    info = _xlac()._get_xla_tensor_debug_info(t)
    return int(re.search(r"AliasID: (-?\d+)", info).group(1))


def sharding_spec(t: torch.Tensor) -> str:
    """The SPMD sharding ``t`` is annotated with, in HLO's syntax ("" if none)."""
    return _xlac()._get_xla_sharding_spec(t)


def activate_preemption_sync() -> Optional[str]:
    """Starts the XLA runtime's preemption sync point (the one torch_xla's
    ``CheckpointManager`` uses); returns None, or why the runtime does not provide it (it
    needs the distributed runtime's coordination service, as on a multi-host TPU slice)."""
    try:
        _xlac()._activate_preemption_sync_manager()
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[-1]
    return None


def preemption_sync_point_reached(step: int) -> bool:
    """Whether the runtime's preemption sync point says every process is to stop at
    ``step`` (after ``activate_preemption_sync`` succeeded)."""
    return bool(_xlac()._sync_point_reached(step))


def start_alone(tensors: Sequence[torch.Tensor]) -> None:
    """Starts computing the pending graph of ``tensors`` as a computation of its own and
    returns without waiting for it. Their graph must depend on no other pending collective
    (trace its collectives under ``fresh_collective_token``)."""
    _xlac()._xla_sync_multi(list(tensors), devices=[], wait=False)
