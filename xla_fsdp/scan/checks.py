"""What a scanned stack cannot run, refused before it runs.

The scan runs every layer as copies of one traced layer (``scan.trace``), so anything that
would make a layer compute differently from layer 0, or that a loop body cannot carry out
(hooks, running statistics, writes to its inputs), is refused here with the module or
attribute at fault.

[Note: attributes that differ between layers]
The scan runs every layer with one trace, made on layer 0. An attribute allowed to differ
(``ignored_attributes``) is harmless only if the computation does not read it, and some
models do: GPT-2 with ``scale_attn_by_inverse_layer_idx`` divides its scores by
``layer_idx + 1``. Running that with layer 0's trace trains silently wrong. So when such
attributes differ, the layer's forward (``forward_graph``, traced once anyway to find
writes to inputs) is traced again with the values of a few other layers, and any change in
the graph is refused. The layers compared are 1, the middle one and the last, not all of them (which
would cost a trace per layer): a use that agrees on those and differs elsewhere, or one
that reaches the graph only as a tensor constant's value, is not caught.
"""
from __future__ import annotations

import enum
import inspect
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from .._init.mixed_precision import float32_modules
from .._unit.module_parameters import registered_parameters
from .._unit.unit_state import is_unit
from .._xla.private_api import is_batch_norm, module_hook_count, op_schema


def forward_graph(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]
                  ) -> fx.GraphModule:
    """The layer's forward as ATen ops, traced on fake tensors (about 0.1 s for a decoder
    layer), with in-place ops kept as they are."""
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)


def refuse_input_mutation(graph: fx.GraphModule, names: Sequence[str]) -> None:
    """A layer that writes to an input (a buffer updated in forward, an in-place op on its
    argument) would write to one loop slice that is thrown away; ``names`` names the inputs
    in order."""
    placeholders = {n: i for i, n in enumerate(graph.graph.nodes) if n.op == "placeholder"}
    for node in graph.graph.nodes:
        schema = op_schema(node.target)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for k, arg in enumerate(schema.arguments):
            written = arg.alias_info is not None and arg.alias_info.is_write
            target = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
            base = _view_base(target) if written else None
            if base in placeholders:
                raise ValueError(
                    f"a scanned layer writes in place to {names[placeholders[base]]} "
                    f"({node.target}): the loop runs each layer on a slice it does not write "
                    f"back. Compute a new tensor instead, or do not scan this stack")


def tensor_attributes(layer: nn.Module, placeholders: set) -> List[str]:
    """Plain tensor attributes (neither parameters nor buffers), other than the parameters'
    placeholders ``(id(module), name)``: the tracer cannot take them as per-layer inputs."""
    return [f"{path + '.' if path else ''}{name}" for path, m in layer.named_modules()
            for name, v in vars(m).items()
            if isinstance(v, torch.Tensor) and (id(m), name) not in placeholders]


def _view_base(node: Any) -> Any:
    """The tensor a chain of views starts from."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        schema = op_schema(node.target)
        returns = schema.returns if schema is not None else []
        if not (returns and returns[0].alias_info is not None and node.args):
            break
        node = node.args[0]
    return node


def varying_attributes(layers: List[nn.Module], ignored: Tuple[str, ...]
                        ) -> List[Tuple[str, str, List[Any]]]:
    """(submodule path, attribute, value per layer) of each ignored attribute that differs."""
    out = []
    for path, m in layers[0].named_modules():
        for name in ignored:
            if name in vars(m):
                values = [vars(layer.get_submodule(path)).get(name) for layer in layers]
                if any(v != values[0] for v in values):
                    out.append((path, name, values))
    return out


def refuse_varying_computation(fn: Callable[..., torch.Tensor], inputs: List[torch.Tensor],
                                template: nn.Module,
                                varying: List[Tuple[str, str, List[Any]]], reference: str) -> None:
    """See [Note: attributes that differ between layers]; ``template`` is layer 0, whose
    traced forward is ``reference``."""
    def graph_with_values_of(k: int) -> str:
        for path, name, values in varying:
            template.get_submodule(path).__dict__[name] = values[k]
        try:
            return forward_graph(fn, inputs).code
        finally:
            for path, name, values in varying:
                template.get_submodule(path).__dict__[name] = values[0]

    layers = len(varying[0][2])
    for k in sorted({1, layers // 2, layers - 1} - {0}):
        if graph_with_values_of(k) != reference:
            differ = ", ".join(f"'{path + '.' if path else ''}{name}' (layer 0: {values[0]!r}, "
                               f"layer {k}: {values[k]!r})" for path, name, values in varying
                               if values[k] != values[0])
            raise ValueError(
                f"scanned layers differ in {differ}, and the layer's computation reads it: "
                f"the scan would run every layer as layer 0. Make the layers compute alike "
                f"(e.g. GPT-2's scale_attn_by_inverse_layer_idx=False) or do not scan them")


def hook_counts(layers: Sequence[nn.Module]) -> List[Tuple[str, nn.Module, int]]:
    """Every module of every layer, named for a message, with the hooks it has now."""
    return [(f"layer {k}" + (f" ({path})" if path else ""), m, module_hook_count(m))
            for k, layer in enumerate(layers) for path, m in layer.named_modules()]


def refuse_later_hooks(counted: Sequence[Tuple[str, nn.Module, int]]) -> None:
    """Refuses a module hook registered on a layer since ``hook_counts`` counted them (when
    the stack was built): the scan runs its one trace of the layer and would never call it.
    Checked at every call, over every layer: a hook on one layer but the first changes
    nothing the traces are keyed on."""
    for where, m, count in counted:
        if module_hook_count(m) != count:
            raise ValueError(
                f"{where} of a ScannedLayers stack has a module hook registered after the "
                f"stack was built ({type(m).__name__}): the scan runs one trace of the layer "
                f"and would never call it. Hook the stack itself, or do not scan this stack")


def describe_layer(layer: nn.Module, ignored: Tuple[str, ...], hooks: bool = False
                   ) -> Dict[str, Any]:
    """What the scan's one trace assumes of every layer: each module's type, parameters'
    shapes, buffers and plain settings (but ``ignored``); refuses what no scan can run (nested
    units, running statistics, and unless ``hooks`` (the stack's own, once built) module
    hooks)."""
    out: Dict[str, Any] = {}
    for path, m in layer.named_modules(remove_duplicate=False):
        where = path or "(the layer)"
        if is_unit(m):
            raise ValueError(f"{where} of a scanned layer is an FSDP unit; a scanned stack "
                             f"is one unit, with nothing wrapped inside it")
        if is_batch_norm(m) and m.track_running_stats:
            raise ValueError(f"{where} ({type(m).__name__}) updates running statistics "
                             f"in forward, which a scan cannot carry out per layer")
        if not hooks and module_hook_count(m):
            raise ValueError(f"{where} ({type(m).__name__}) has module hooks, which the "
                             f"scan would not call")
        out[f"{path}:type"] = type(m)
        for name, p in registered_parameters(m, recurse=False, remove_duplicate=False):
            out[f"{path}.{name}"] = ("parameter", tuple(p.shape), p.dtype, p.requires_grad)
        for name, b in m.named_buffers(recurse=False, remove_duplicate=False):
            out[f"{path}.{name}"] = ("buffer", tuple(b.shape), b.dtype)
        for name, v in vars(m).items():
            if name.startswith("_") or name in ignored or isinstance(v, (torch.Tensor, nn.Module)):
                continue
            # a method set on the instance (a patched forward) is bound to each layer's
            # module: what it runs is its function
            out[f"{path}.{name}"] = ("method", v.__func__) if inspect.ismethod(v) \
                else ("attribute", v)
    return out


# argument values the scan keys its traces by: equal values trace alike
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.memory_format, torch.layout, enum.Enum, slice, type(Ellipsis))


def refuse_opaque_arguments(leaves: Sequence[Any], kwargs: Dict[str, Any]) -> None:
    """The scan traces the layer once per set of argument values (tensors by shape) and runs
    that trace for every layer. An object among the arguments (a Hugging Face KV cache the
    layers fill one by one, anything holding tensors or changed between calls) is neither:
    what a layer reads from or writes to it the trace fixes, so it is refused."""
    for x in leaves:
        if isinstance(x, (torch.Tensor,) + _PLAIN):
            continue
        name = next((f"{k}=" for k, v in kwargs.items() if v is x), "an argument ")
        hint = (" (a Hugging Face model passes its KV cache when use_cache is on: train with "
                "model.config.use_cache = False)" if "Cache" in type(x).__name__ else "")
        raise TypeError(
            f"ScannedLayers: {name}{type(x).__name__} object: the scan runs one trace of the "
            f"layer for every layer and call with the same argument values, and cannot "
            f"follow what a layer reads from or writes to an object. Pass tensors and plain "
            f"values (None, numbers, strings, dtypes), in lists, tuples or dicts{hint}")


def refuse_float32_modules(layer: nn.Module, compute_dtype: torch.dtype) -> None:
    """A unit runs some modules in float32 under a low-precision ``compute_dtype``
    (``_init.mixed_precision``); the scan runs every parameter of a layer in
    ``compute_dtype``, so it refuses a layer that has one."""
    fp32 = float32_modules(layer.modules(), compute_dtype)
    for path, m in layer.named_modules():
        if id(m) in fp32:
            raise ValueError(
                f"{path or '(the layer)'} ({type(m).__name__}) of a scanned layer would compute "
                f"in {compute_dtype}, where a unit computes it in float32: a scanned stack runs "
                f"all of a layer in compute_dtype. Wrap these layers with FSDP one by one, or "
                f"scan them with float32 compute")


def check_identical(layers: List[nn.Module], ignored: Tuple[str, ...], hooks: bool = False
                    ) -> None:
    """Refuses layers the scan cannot run as copies of one: differing structure, shapes,
    settings, shared parameters, hooks (unless ``hooks``), nested units or running
    statistics."""
    reference = describe_layer(layers[0], ignored, hooks)
    seen: Dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            if seen.setdefault(id(p), i) != i:
                raise ValueError(f"layers {seen[id(p)]} and {i} share a parameter; scanned "
                                 f"layers must each hold their own")
        if i == 0:
            continue
        other = describe_layer(layer, ignored, hooks)
        for key in sorted(set(reference) | set(other)):
            if reference.get(key) != other.get(key):
                raise ValueError(
                    f"scanned layers must be identical in structure; layer {i} differs from "
                    f"layer 0 at '{key}': {other.get(key)!r} against {reference.get(key)!r}")
