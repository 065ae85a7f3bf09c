"""One layer of a scanned stack, traced once into a forward and a backward graph.

The scan's loop bodies (``scan.loop``) run these graphs on one layer's full parameters. The
graphs hold no collectives: the bodies gather before calling them and reduce-scatter after,
so the trace needs nothing from torch_xla but ordinary ATen ops.

[Note: what the scan saves for backward]
AOTAutograd's partitioners decide which forward values the backward reads. Any value they
save that is computed from the weights alone (a transpose, a cast, ``1 + w``) is weight-
sized, and the forward loop would stack it for every layer: all layers' weights at once.
The partition here marks every forward op whose inputs are, transitively, parameters only as
``MUST_RECOMPUTE``; the min-cut partitioner then recomputes them in the backward graph from
the parameters, which the backward body has gathered again. (For plain linear layers the
partitioners save the weight itself, an input, so the marking changes nothing there.) A saved value that *is* an
input (a parameter, the layer input, an invariant argument) is not stacked either: the
backward body has it already (``LayerGraphs.saved_inputs``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from .._xla.private_api import decompositions


@dataclass(frozen=True)
class LayerGraphs:
    forward: fx.GraphModule    # (*inputs) -> (output, *saved)
    backward: fx.GraphModule   # (*saved, grad of output) -> grad of each input (or None)
    saved_inputs: Tuple[Optional[int], ...]  # per saved value: the input it is, or None

    @property
    def draws_random(self) -> bool:
        """The forward draws random numbers (dropout): see [Note: dropout in a scanned layer]."""
        return any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
                   for n in self.forward.graph.nodes if n.op == "call_function")

    @property
    def given_gradients(self) -> Tuple[bool, ...]:
        """Per input of the layer, whether its backward gives it a gradient: a parameter the
        layer never uses gets None, as it does unscanned."""
        (returned,) = [n.args[0] for n in self.backward.graph.nodes if n.op == "output"]
        return tuple(g is not None for g in returned)

    @property
    def stacked_saved(self) -> List[int]:
        """Positions of the saved values the forward loop must stack, one per layer."""
        return [i for i, k in enumerate(self.saved_inputs) if k is None]


def trace_layer(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                requires_grad: Sequence[bool], weights: Set[int]) -> LayerGraphs:
    """Traces ``fn(*inputs) -> tensor`` with AOTAutograd. ``weights`` are the positions of
    the full parameters (see [Note: what the scan saves for backward])."""
    from functorch.compile import aot_function, make_boxed_func

    captured: List[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, _example: object) -> Callable:
        captured.append(gm)
        return make_boxed_func(gm)

    def no_alias(*args: torch.Tensor) -> torch.Tensor:
        out = fn(*args)
        return out.clone() if any(out is a for a in args) else out

    examples = [torch.empty_like(t).requires_grad_(g) for t, g in zip(inputs, requires_grad)]
    with torch.enable_grad():
        traced = aot_function(no_alias, fw_compiler=keep, bw_compiler=keep,
                              partition_fn=_recompute_weight_ops(weights),
                              decompositions=_dropout_decompositions())
        out = traced(*examples)
        if not out.requires_grad:
            raise ValueError("the layer's output does not depend on its input or parameters")
        out.backward(torch.ones_like(out))
    forward, backward = captured
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    (returned,) = [n.args[0] for n in forward.graph.nodes if n.op == "output"]
    saved = list(returned[1:])
    index = {n: i for i, n in enumerate(placeholders)}
    expected = len(saved) + 1
    got = sum(1 for n in backward.graph.nodes if n.op == "placeholder")
    if got != expected:
        raise NotImplementedError(f"the layer's backward graph takes {got} inputs, expected "
                                  f"{expected} (saved values and one gradient)")
    return LayerGraphs(forward, backward,
                       tuple(index.get(n) if isinstance(n, fx.Node) else None for n in saved))


def _dropout_decompositions() -> Dict[Any, Callable]:
    # [Note: dropout in a scanned layer]
    # Traced, ``nn.Dropout`` becomes ``aten.native_dropout``, which eager torch_xla never
    # calls (its ``F.dropout`` draws a Bernoulli mask instead), and whose XLA kernel in 2.9
    # is wrong: for p = 0.3 it scales the kept values by 1/p, not 1/(1 - p), and returns a
    # mask whose mean is 2.4. PyTorch's own decomposition (a Bernoulli draw, a boolean mask
    # saved for backward) is traced instead. Each loop iteration draws its own mask.
    # The loop's draws do not follow torch_xla's seed (``xm.set_rng_state``), so a stack that
    # draws cannot be recomputed consistently: a call from inside backward (reentrant
    # ``torch.utils.checkpoint`` around the stack) is refused by ``ScannedLayers``.
    aten = torch.ops.aten
    return decompositions([aten.native_dropout, aten.native_dropout_backward])


def _recompute_weight_ops(weights: Set[int]) -> Callable:
    from functorch.compile import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    def partition(joint: fx.GraphModule, joint_inputs: object, **kwargs: object):
        primals = [n for n in joint.graph.nodes
                   if n.op == "placeholder" and str(n.target).startswith("primals")]
        weight_only = {primals[i] for i in weights}
        for node in joint.graph.nodes:
            if node.op != "call_function":
                continue
            inputs = node.all_input_nodes
            if inputs and all(a in weight_only for a in inputs):
                weight_only.add(node)
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                # one region: the partitioner would otherwise save the boundary between two
                # chained marked ops as if they belonged to consecutive checkpointed regions
                node.meta["ac_graph_id"] = 0
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    return partition
