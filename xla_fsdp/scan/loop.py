"""The forward and backward loops of a scanned stack: two XLA while loops whose bodies are
compiled once, whatever the number of layers.

forward, layer ``l``: all-gather layer ``l``'s shards -> the layer's forward graph ->
the carried hidden state, and the layer's saved values, stacked for backward.
backward, layer ``l`` from last to first: all-gather layer ``l``'s shards again -> the
layer's backward graph on its saved values -> the carried gradient of the hidden state, and
layer ``l``'s parameter gradients, reduce-scattered into a stacked shard gradient.

Each body holds one layer's full parameters and gradients at a time; nothing full-size
leaves a body (see [Note: what the scan saves for backward] in ``scan.trace``).

[Note: the collective token inside a loop body]
torch_xla chains the collectives of a device through a per-device token. A collective traced
inside a body would leave the body's token as the device's token, and the next collective
outside would depend on a value of another computation (the process dies, SIGSEGV). The
bodies are traced with a fresh token, and the outer one is put back after
(``_xla.private_api.fresh_collective_token``).

[Note: gathering the next layer ahead]
Without prefetch, a body gathers its own layer and then computes with it: the layer's
compute waits for its gather. With ``prefetch=True`` the carry holds the current layer
already gathered, and the body issues the gather of the next layer (in the loop's
direction) beside the current layer's compute, which does not depend on it, so a runtime
with asynchronous collectives (TPU) can overlap the two. The price: two layers' full
parameters live at once, and one gather more than there are layers per loop (the carry
wraps around to a layer that is not run). On XLA:CPU collectives are synchronous, so no
time is gained here; only parity and the graph's structure can be checked.

[Note: booleans through the loop]
torch_xla 2.9's scan hands a body a boolean ``xs`` slice as int64 and stacks a boolean ``ys``
as int64, silently. Boolean values still mean the same as masks, but ``~mask`` of an int64
is ``-1``/``-2``, both true: a causal mask saved for backward (``ones(t, t).tril()``) or a
boolean buffer then masks everything, and gradients come out wrong with no error. Booleans
cross the loop boundary as uint8 and are made boolean again on each side.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .._sharding.collectives import (Collectives, gather_pieces, padded_gradient,
                                     scatter_gradients)
from .._sharding.layout import unshard_all
from .._unit.options import FsdpOptions
from .._unit.shard_group import ShardGroup
from .._xla.private_api import fresh_collective_token, scan_flat
from .trace import LayerGraphs


@dataclass
class ScanLoop:
    """One call of a scanned stack. Layer inputs: ``[hidden, *invariants, *parameters,
    *buffers]``; invariants are the same for every layer, parameters and buffers stacked."""
    graphs: LayerGraphs
    invariants: List[torch.Tensor]
    differentiable: List[bool]          # per invariant: its gradient is carried in backward
    shard_groups: List[ShardGroup]      # the stacked shard groups, in parameter order
    buffers: List[torch.Tensor]         # stacked, [L, ...]
    collectives: Collectives
    options: FsdpOptions
    divide: Tuple[float, float]
    prefetch: bool = False              # see [Note: gathering the next layer ahead]

    # -- the two loops ---------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, save: bool) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        stacked = self.graphs.stacked_saved if save else []
        save_hidden = save and 0 in self.graphs.saved_inputs
        n = len(self.shard_groups)

        def body(carry: List[torch.Tensor], xs: List[torch.Tensor]):
            h, ahead = carry[0], carry[1:]
            params = ahead[1:] if self.prefetch else self._gather(xs[:n])
            out = self.graphs.forward(h, *self.invariants, *params, *xs[n:])
            saved = out[1:]
            ys = [saved[i] for i in stacked] + ([h] if save_hidden else [])
            return [out[0], *self._advance(ahead, 1)], ys

        carry, ys = _loop(body, [hidden, *self._start(0)], self._xs())
        return carry[0], ys

    def backward(self, grad: torch.Tensor, ys: Sequence[torch.Tensor]
                 ) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]], List[Optional[torch.Tensor]]]:
        stacked = self.graphs.stacked_saved
        carried = [i for i, d in enumerate(self.differentiable) if d]
        trainable = self._given_gradients()
        base, n = len(self._xs()), len(self.shard_groups)

        def body(carry: List[torch.Tensor], xs: List[torch.Tensor]):
            g_h = carry[0]
            acc, ahead = carry[1:1 + len(carried)], carry[1 + len(carried):]
            layer_ys = xs[base:]
            h = layer_ys[len(stacked)] if len(layer_ys) > len(stacked) else None
            params = ahead[1:] if self.prefetch else self._gather(xs[:n])
            inputs = [h, *self.invariants, *params, *xs[n:base]]
            news = dict(zip(stacked, layer_ys))
            saved = [inputs[k] if k is not None else news[i]
                     for i, k in enumerate(self.graphs.saved_inputs)]
            grads = self.graphs.backward(*saved, g_h)
            g_prev = grads[0] if grads[0] is not None else torch.zeros_like(g_h)
            acc = [a if grads[1 + i] is None else a + grads[1 + i]
                   for a, i in zip(acc, carried)]
            # the next (lower) layer's gather is issued before this layer's reduce-scatter
            ahead = self._advance(ahead, -1)
            return [g_prev, *acc, *ahead], self._reduce(grads, trainable, g_h.device)

        init = ([grad] + [torch.zeros_like(self.invariants[i]) for i in carried]
                + self._start(self._layers() - 1))
        carry, reduced = _loop(body, init, self._xs() + list(ys), reverse=True)
        g_inv = dict(zip(carried, carry[1:1 + len(carried)]))
        g_shards = dict(zip(trainable, reduced))
        return (carry[0], [g_inv.get(i) for i in range(len(self.invariants))],
                [g_shards.get(i) for i in range(len(self.shard_groups))])

    def _given_gradients(self) -> List[int]:
        """The shard groups whose shards get a gradient: trainable, with a parameter the
        layer's backward reaches. A group of parameters the layer never uses is not reduced,
        and its shard's ``.grad`` stays None, as unscanned: a zero gradient would still
        move it under weight decay and count an AdamW step."""
        given = self._per_group(self.graphs.given_gradients)
        return [i for i, g in enumerate(self.shard_groups)
                if g.shard.requires_grad and any(given[i])]

    def _per_group(self, layer_inputs: Sequence[Any]) -> List[Sequence[Any]]:
        """``layer_inputs`` (one per input of the layer) cut into each shard group's
        parameters' part."""
        at, out = 1 + len(self.invariants), []
        for g in self.shard_groups:
            k = len(g.layout.layer.shapes)
            out.append(layer_inputs[at:at + k])
            at += k
        return out

    # -- prefetching (see [Note: gathering the next layer ahead]) ---------------------------
    def _layers(self) -> int:
        return self.shard_groups[0].shard.shape[0]

    def _start(self, layer: int) -> List[torch.Tensor]:
        """The carry that holds the layer about to run, gathered: its index and parameters."""
        if not self.prefetch:
            return []
        return self._ahead(torch.tensor(layer, dtype=torch.int64,
                                        device=self.shard_groups[0].local().device))

    def _advance(self, ahead: List[torch.Tensor], step: int) -> List[torch.Tensor]:
        """Gathers the layer after the current one in the loop's direction (wrapping at the
        end: one gather more than layers)."""
        return self._ahead(ahead[0] + step) if self.prefetch else []

    def _ahead(self, index: torch.Tensor) -> List[torch.Tensor]:
        """The carry's index and layer ``index``'s parameters, gathered."""
        row = torch.remainder(index, self._layers()).view(1)
        rows = [torch.index_select(g.local().detach(), 0, row).squeeze(0)
                for g in self.shard_groups]
        return [index, *self._gather(rows)]

    # -- one layer -------------------------------------------------------------------------
    def _xs(self) -> List[torch.Tensor]:
        return [g.local().detach() for g in self.shard_groups] + list(self.buffers)

    def _gather(self, shards: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        gathered = gather_pieces(self.collectives,
                                 [(g.layout.layer, s, g.compute_dtype)
                                  for g, s in zip(self.shard_groups, shards)],
                                 self.options.coalesce_all_gather_ops)
        return unshard_all([g.layout.layer for g in self.shard_groups], gathered)

    def _reduce(self, grads: Sequence[Optional[torch.Tensor]], trainable: List[int],
                device: Any) -> List[torch.Tensor]:
        if not trainable:
            return []
        per_group = self._per_group(grads)
        flats = [padded_gradient(self.shard_groups[i].layout.layer, per_group[i],
                                 self.shard_groups[i].compute_dtype, device,
                                 self.options.fp32_reduce_scatter, self.divide)
                 for i in trainable]
        return scatter_gradients(self.collectives, self.divide, flats,
                                 self.options.replica_groups,
                                 float32=not self.options.offload_optimizer)


class ScanFunction(torch.autograd.Function):
    """Autograd's view of a scanned stack: ``(loop, hidden, *invariants, *shards)`` ->
    the last layer's output, ``shards`` being each group's ``local()`` tensor. Their
    gradients, already reduce-scattered, go to the shard groups (``add_gradient``) as an
    ordinary unit's do, not through autograd: an offloaded shard's device copy is not the
    parameter that holds its gradient."""

    @staticmethod
    def forward(ctx: Any, loop: ScanLoop, hidden: torch.Tensor, *tensors: torch.Tensor
                ) -> torch.Tensor:
        out, ys = loop.forward(hidden, save=True)
        ctx.loop = loop
        ctx.save_for_backward(*ys)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        loop: ScanLoop = ctx.loop
        g_h, g_inv, g_shards = loop.backward(grad.contiguous(), ctx.saved_tensors)
        for shard_group, g in zip(loop.shard_groups, g_shards):
            if g is not None:
                shard_group.add_gradient(g)
        return (None, g_h, *g_inv, *[None] * len(g_shards))


def _loop(body: Callable, init: List[torch.Tensor], xs: List[torch.Tensor],
          reverse: bool = False) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    # see [Note: booleans through the loop]
    xs_bool = [x.dtype == torch.bool for x in xs]
    ys_bool: List[bool] = []

    def bool_safe(carry: List[torch.Tensor], layer_xs: List[torch.Tensor]):
        layer_xs = [x.bool() if b else x for x, b in zip(layer_xs, xs_bool)]
        carry, ys = body(carry, layer_xs)
        ys_bool[:] = [y.dtype == torch.bool for y in ys]
        return carry, [y.to(torch.uint8) if b else y for y, b in zip(ys, ys_bool)]

    xs = [x.to(torch.uint8) if b else x for x, b in zip(xs, xs_bool)]
    # see [Note: the collective token inside a loop body]
    with torch.no_grad(), fresh_collective_token():
        carry, ys = scan_flat(bool_safe, init, xs, reverse=reverse)
    return list(carry), [y.bool() if b else y for y, b in zip(ys, ys_bool)]
