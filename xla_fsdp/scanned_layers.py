"""ScannedLayers: a stack of identical layers as one FSDP unit that runs as an XLA loop.

    model.layers = ScannedLayers(model.layers, **fsdp_options)   # an nn.ModuleList
    model = XlaFullyShardedDataParallel(model, **fsdp_options)

(the options about a whole unit's schedule, such as ``reshard_after_forward``, do not apply
to the stack: given other than their defaults, the stack says it ignores them).

The step then compiles one layer's forward and one layer's backward, whatever the depth:
the layers run as a while loop over stacked shards (``scan.loop``), one layer gathered at a
time, forward and backward. The model's code does not change: iterating the stack yields
one callable that runs every layer, so ``for layer in self.layers: h = layer(h, ...)`` (or
Hugging Face's ``for layer in self.layers[:n]``) runs the scan once.

A layer is called as ``layer(hidden, *args, **kwargs)``: the first argument is carried from
layer to layer, the others are the same for every layer (attention masks, rotary tables;
their gradients are summed over the layers). Its output is the next hidden state, or a
tuple of it and ``None``s.

Checkpoints and ``full_state_dict()`` name every layer's parameters as the unwrapped model
does (``layers.3.mlp.fc1.weight``); the shards are ``StackedLayout`` groups.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ._init.find_parameters import find_parameters
from ._init.mixed_precision import float32_statistics
from ._init.shard_members import ShardedParameters, shard_members
from ._init.validate import validate_module
from ._sharding.tensor_tree import cast_floating
from ._unit.buffers import place_buffers
from ._unit.param_record import ParamRecord
from ._unit.unit_params import UnitParams
from ._unit.unit_state import UnitState
from ._xla.private_api import in_backward, tree_flatten, tree_unflatten
from .fully_sharded import options_from_keywords
from .scan.checks import (check_identical, describe_layer, forward_graph, hook_counts,
                          refuse_float32_modules, refuse_input_mutation, refuse_later_hooks,
                          refuse_opaque_arguments, refuse_varying_computation,
                          tensor_attributes, varying_attributes)
from .scan.loop import ScanFunction, ScanLoop
from .scan.trace import LayerGraphs, trace_layer
from .unit_module import UnitModule

# attributes that may differ between layers because they only index a per-layer cache,
# which training does not use (Hugging Face's ``layer_idx``); see
# [Note: attributes that differ between layers]
IGNORED_ATTRIBUTES = ("layer_idx",)


# the options about a whole unit's schedule, which a stack's scan does not follow
_WHOLE_UNIT_OPTIONS = ("reshard_after_forward", "optimization_barrier_in_forward",
                       "optimization_barrier_in_backward", "reduce_scatter_bucket_size_mb",
                       "zero_missing_gradients")


class ScannedLayers(UnitModule):
    """Shards a stack of structurally identical layers as one unit and runs them as a scan.

    Takes an ``nn.ModuleList`` (or ``nn.Sequential``, or a list of modules) and the
    options of ``XlaFullyShardedDataParallel``, except ``auto_wrap_policy``. The options
    about a whole unit's schedule do not apply to a stack, whose scan gathers, frees and
    reduces one layer at a time: ``reshard_after_forward``, ``optimization_barrier_in_*``,
    ``reduce_scatter_bucket_size_mb`` and ``zero_missing_gradients`` (a parameter the
    layer never uses gets no gradient, as unscanned without that option); set to other than
    their defaults, they are ignored with a warning. Under ``no_sync`` the gradients are still
    reduce-scattered, one layer at a time (the sum is the same; the communication is not
    saved). ``ignored_attributes`` names plain attributes that may differ between layers; the
    others may change after wrapping on every layer alike (dropout's ``p``), which traces the
    layer anew, and a change seen on the first layer that the others do not share is
    refused. ``prefetch_next_layer=True`` gathers the next layer beside the current layer's
    compute, at the cost of a second layer's full parameters
    (see [Note: gathering the next layer ahead] in ``scan.loop``)."""

    def __init__(self, layers: Union[nn.ModuleList, nn.Sequential, Sequence[nn.Module]],
                 ignored_attributes: Sequence[str] = IGNORED_ATTRIBUTES,
                 prefetch_next_layer: bool = False, **kwargs: Any) -> None:
        if kwargs.pop("auto_wrap_policy", None) is not None:
            raise ValueError("ScannedLayers shards the stack as one unit; auto_wrap_policy "
                             "would wrap inside its layers, which the scan cannot run")
        kwargs.pop("auto_wrapper_callable", None)
        if isinstance(layers, (list, tuple)):
            layers = nn.ModuleList(layers)
        validate_module(layers, needs_forward=False)
        if not isinstance(layers, (nn.ModuleList, nn.Sequential)) or len(layers) == 0:
            raise TypeError(f"ScannedLayers takes a non-empty nn.ModuleList or nn.Sequential "
                            f"of identical layers, got {type(layers).__name__}")
        ignored = tuple(ignored_attributes)
        check_identical(list(layers), ignored)
        options = options_from_keywords(kwargs, "ScannedLayers")
        defaults = options_from_keywords({}, "ScannedLayers")
        unused = [f"{k}={kwargs[k]!r}" for k in _WHOLE_UNIT_OPTIONS
                  if k in kwargs and getattr(options, k) != getattr(defaults, k)]
        if unused:
            warnings.warn(f"ScannedLayers ({len(layers)} x {type(layers[0]).__name__}) ignores "
                          f"{', '.join(unused)}: a stack's scan gathers, frees and reduces one "
                          f"layer at a time, whatever a whole unit's schedule says",
                          stacklevel=2)
        refuse_float32_modules(layers[0], options.compute_dtype)
        self.__dict__["_varying"] = varying_attributes(list(layers), ignored)
        self.__dict__["_ignored"] = ignored
        self.__dict__["_scan_cache"] = {}
        self.__dict__["_tracing"] = False
        self.__dict__["_prefetch"] = bool(prefetch_next_layer)
        refusal = (f"ScannedLayers ({len(layers)} x {type(layers[0]).__name__}) cannot run "
                   f"inside torch.compile: Dynamo cannot trace the scan, whose loop is already "
                   f"one compiled XLA computation. Either keep the scan and run the model "
                   f"without torch.compile, or compile per layer instead of ScannedLayers: "
                   f"each layer its own unit around its compiled module, "
                   f"FSDP(torch.compile(layer)) (auto-wrap builds these for layers compiled "
                   f"before wrapping)")
        super().__init__([layers], layers, options, type(layers).__name__, detached=False,
                         compile_refusal=refusal)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(self._refuse_direct_call(i))
        # layer 0's descriptions the stack has run with, as sharding left it; the index of
        # the current one keys the traces (see ``_settings_seen``)
        self.__dict__["_descriptions"] = [describe_layer(layers[0], ignored, hooks=True)]
        self.__dict__["_hook_counts"] = hook_counts(list(layers))
        self.__dict__["_last_settings"] = 0

    # -- the stack as Hugging Face's loops see it ------------------------------------------
    def __len__(self) -> int:
        return len(self.wrapped_module)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter([self])  # one step that runs every layer

    def __getitem__(self, key: Union[int, slice]) -> nn.Module:
        if isinstance(key, slice):
            if list(range(len(self))[key]) != list(range(len(self))):
                raise IndexError(f"a ScannedLayers stack runs as a whole; {key} selects only "
                                 f"some of its {len(self)} layers")
            return self
        return self.wrapped_module[key]

    def _fall_through_to(self) -> Sequence[Any]:
        # the model's loop may read a setting off the layer it calls (Qwen2 picks its mask by
        # ``layer.attention_type``): the layers agree on every setting (``check_identical``)
        return (self.wrapped_module, self.wrapped_module[0])

    def _refuse_direct_call(self, index: int) -> Callable:
        def hook(_module: nn.Module, _args: Any) -> None:
            if not self._tracing:
                raise RuntimeError(f"layer {index} of a ScannedLayers stack runs only inside "
                                   f"the scan: call (or iterate) the stack, not its layers")
        return hook

    # -- sharding at construction ----------------------------------------------------------
    def _new_state(self, name: str, members: List[nn.Module], params: UnitParams,
                   detached: bool, compile_refusal: Optional[str]) -> UnitState:
        # the loop takes each layer's gradients and reduces them itself: nothing to hook
        return UnitState(self, name, members, params, self.options, detached, compile_refusal)

    def _shard_members(self, roots: List[Tuple[str, nn.Module]]) -> ShardedParameters:
        ((_, stack),) = roots
        found = [find_parameters([(str(i), layer)], self) for i, layer in enumerate(stack)]
        sharded = shard_members(found, True, self.options, self.xla_device,
                                self.unit_state.name, lambda _owners: self.compute_dtype)
        place_buffers(stack, self.buffer_dtype, self.xla_device,
                      keep=float32_statistics(stack.modules()))
        return sharded

    # -- forward ---------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"ScannedLayers carries its first argument from layer to layer; "
                            f"it must be a tensor, got {type(hidden).__name__}")
        self.unit_state.sync_trainable()  # frozen through a layer's attribute since wrapping
        refuse_later_hooks(self._hook_counts)
        settings = self._settings_seen()
        if self.compute_dtype != torch.float32:
            hidden, args, kwargs = cast_floating(self.compute_dtype, (hidden, args, kwargs))
        leaves, spec = tree_flatten((args, kwargs))
        refuse_opaque_arguments(leaves, kwargs)
        tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        invariants = [leaves[i] for i in tensors]
        differentiable = [t.is_floating_point() and t.requires_grad for t in invariants]
        shard_groups = self.shard_groups
        stack = self.wrapped_module
        buffer_slots = [(name, [layer.get_buffer(name) for layer in stack])
                        for name, _ in stack[0].named_buffers()]
        buffers = [torch.stack(values) for _, values in buffer_slots]
        key = (tuple((tuple(t.shape), t.dtype) for t in [hidden] + invariants),
               tuple(differentiable), str(spec),
               tuple(repr(x) for i, x in enumerate(leaves) if i not in set(tensors)),
               settings, tuple(g.shard.requires_grad for g in shard_groups))
        if key not in self._scan_cache:
            self._scan_cache[key] = self._trace(hidden, invariants, differentiable, leaves,
                                                tensors, spec, buffer_slots)
        graphs, rebuild = self._scan_cache[key]
        if graphs.draws_random and in_backward():
            raise RuntimeError(
                "a ScannedLayers stack whose layers draw random numbers (dropout) is being "
                "recomputed inside backward (torch.utils.checkpoint around it): the loop's "
                "draws ignore the restored seed, so the recomputation would use other dropout "
                "masks than the forward. Do not checkpoint the stack (the scan saves only "
                "activations, never weights), or set dropout to 0")
        loop = ScanLoop(graphs, invariants, differentiable, shard_groups, buffers,
                        self.collectives, self.options, self.unit_state.params.divide,
                        self._prefetch)
        grad = torch.is_grad_enabled() and (hidden.requires_grad or any(differentiable) or
                                            any(g.shard.requires_grad for g in shard_groups))
        if not grad:   # evaluation: nothing is saved for a backward
            return rebuild(loop.forward(hidden, save=False)[0])
        return rebuild(ScanFunction.apply(loop, hidden, *invariants,
                                          *[g.local() for g in shard_groups]))

    def _settings_seen(self) -> int:
        """Which of the settings the stack has run with its layers have now (``training``,
        dropout's ``p``, any plain attribute): each traces the layer anew. Settings changed
        since the last call are checked across every layer again, as at construction; a
        change to other layers than the first alone is not seen here."""
        descriptions, last = self._descriptions, self._last_settings
        # the layers' hooks now include the stack's own (``_refuse_direct_call``)
        now = describe_layer(self.wrapped_module[0], self._ignored, hooks=True)
        if now == descriptions[last]:
            return last
        layers = list(self.wrapped_module)
        check_identical(layers, self._ignored, hooks=True)
        self.__dict__["_varying"] = varying_attributes(layers, self._ignored)
        if now not in descriptions:
            descriptions.append(now)
        self.__dict__["_last_settings"] = descriptions.index(now)
        return self._last_settings

    def _trace(self, hidden: torch.Tensor, invariants: List[torch.Tensor],
               differentiable: List[bool], leaves: List[Any], tensors: List[int], spec: Any,
               buffer_slots: List[Tuple[str, List[torch.Tensor]]]
               ) -> Tuple[LayerGraphs, Callable[[torch.Tensor], Any]]:
        template = self.wrapped_module[0]
        shard_groups = self.shard_groups
        records = [r for g in shard_groups for r in g.records[:len(g.layout.layer.shapes)]]
        owners = [r.owners for r in records]
        params = [torch.empty(s, dtype=g.compute_dtype, device=self.xla_device)
                  for g in shard_groups for s in g.layout.layer.shapes]
        n_inv, n_par = len(invariants), len(params)
        structure: Dict[str, Any] = {}

        def layer(*flat: torch.Tensor) -> torch.Tensor:
            h, inv = flat[0], flat[1:1 + n_inv]
            full, bufs = flat[1 + n_inv:1 + n_inv + n_par], flat[1 + n_inv + n_par:]
            values = list(leaves)
            for i, t in zip(tensors, inv):
                values[i] = t
            args, kwargs = tree_unflatten(values, spec)
            with self._holding(template, records, full, [n for n, _ in buffer_slots], bufs):
                out = template(h, *args, **kwargs)
            first, structure["rebuild"] = _carried_output(out, h)
            return first

        inputs = [hidden, *invariants, *params, *[values[0] for _, values in buffer_slots]]
        grads = [True] + differentiable + [g.shard.requires_grad for g in shard_groups
                                           for _ in g.layout.layer.shapes]
        grads += [False] * len(buffer_slots)
        weights = set(range(1 + n_inv, 1 + n_inv + n_par))
        paths = {m: p for p, m in template.named_modules()}
        names = (["the hidden state"] + [f"argument {i + 1}" for i in range(n_inv)]
                 + [f"parameter '{(paths[m] + '.' if paths[m] else '') + a}'"
                    for m, a in (ows[0] for ows in owners)]
                 + [f"buffer '{n}'" for n, _ in buffer_slots])
        try:
            forward = forward_graph(layer, inputs)
            refuse_input_mutation(forward, names)
            if self._varying:
                refuse_varying_computation(layer, inputs, template, self._varying, forward.code)
            graphs = trace_layer(layer, inputs, grads, weights)
        except AssertionError as e:
            loose = tensor_attributes(template, {(id(m), a) for ows in owners for m, a in ows})
            if "FakeTensor" not in str(e) or not loose:
                raise
            raise TypeError(f"a scanned layer reads tensors that are neither parameters nor "
                            f"buffers ({', '.join(loose)}); the scan traces one layer and "
                            f"takes per-layer tensors only from parameters and buffers: "
                            f"register them with register_buffer") from e
        return graphs, structure["rebuild"]

    @contextlib.contextmanager
    def _holding(self, template: nn.Module, records: List[ParamRecord],
                 params: Sequence[torch.Tensor], buffer_names: List[str],
                 buffers: Sequence[torch.Tensor]) -> Iterator[None]:
        """The template layer computes with the traced inputs in place of its placeholders
        (lent as a traced unit lends its full values) and buffers."""
        saved_buffers = []
        for name, value in zip(buffer_names, buffers):
            path, _, attr = name.rpartition(".")
            module = template.get_submodule(path)
            saved_buffers.append((module, attr, module.get_buffer(attr)))
            setattr(module, attr, value)
        ParamRecord.lend(records, params)
        self.__dict__["_tracing"] = True
        try:
            yield
            for (m, a, _), lent, name in zip(saved_buffers, buffers, buffer_names, strict=True):
                if m.get_buffer(a) is not lent:
                    # what refuse_input_mutation refuses of an in-place write, assigned anew
                    raise ValueError(
                        f"a scanned layer assigns its buffer '{name}' in forward: the loop runs "
                        f"each layer on a slice of the stacked buffers and returns none of "
                        f"them, so the new value would be lost. Keep the buffer unchanged in "
                        f"forward, or do not scan this stack")
        finally:
            self.__dict__["_tracing"] = False
            ParamRecord.take_back(records)
            for m, a, old in saved_buffers:
                setattr(m, a, old)


def _carried_output(out: Any, hidden: torch.Tensor) -> Tuple[torch.Tensor, Callable]:
    """The next hidden state in a layer's output, and how to rebuild that output around the
    last layer's."""
    if isinstance(out, torch.Tensor):
        first, rest, kind = out, (), None
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        first, rest, kind = out[0], tuple(out[1:]), type(out)
    else:
        raise TypeError(f"a scanned layer must return its next hidden state (a tensor, or a "
                        f"tuple whose first element is it); got {type(out).__name__}")
    if any(isinstance(x, torch.Tensor) for x in rest):
        raise TypeError("a scanned layer returns more tensors than its next hidden state; "
                        "the scan carries only that one (turn off outputs such as attention "
                        "weights or caches)")
    if first.shape != hidden.shape or first.dtype != hidden.dtype:
        raise TypeError(f"a scanned layer must return a hidden state like its input, "
                        f"{tuple(hidden.shape)} {hidden.dtype}; got {tuple(first.shape)} "
                        f"{first.dtype}")
    if kind is None:
        return first, lambda h: h
    return first, lambda h: kind((h,) + rest)
