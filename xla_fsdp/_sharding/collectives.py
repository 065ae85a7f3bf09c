"""XLA collectives and optimization barriers, and the stateless steps FSDP builds from them:
gathering a unit's shards, padding its gradients for the reduce-scatter, and reducing them. Ordinary units (``UnitParams``) and the scanned layers'
loop bodies use the same steps. Collectives are issued here, or by ``_xla.private_api``
where only torch_xla's private bindings or torch's functional collectives can issue them (a
pinned gather into an output buffer; the collectives a compiled graph traces): no other
module issues one, which ``tests/test_collective_callers.py`` checks on what runs.

All-gathers are always native all-gathers. For a single tensor with ``pin_layout=True``,
``xm.all_gather`` is built from an all-reduce of a zero-padded buffer: it moves
``world_size`` times the data and bakes the rank into the graph. Pinned gathers
therefore use the native all-gather into an output buffer, one per tensor, issued through
the ``bindings`` a ``Collectives`` is given (``_xla.private_api.CollectiveBindings``: this
layer may not import torch_xla's private bindings). torch_xla has no pinned form of the
coalesced (list) all-gather, so coalesced gathers are never pinned.

[Note: collectives off the token chain]
torch_xla threads every collective of a device through one "token": a scalar zero added to
the collective's input, and multiplied by an element of its result to make the next token.
Each collective therefore waits for the previous one, in the order the Python issued them,
and XLA may neither combine two of them nor move one past another. FSDP's forward all-gathers
are issued ``off_token_chain``: each reads the token as it was before it and leaves it so, so it
depends on its shard alone, and XLA may combine gathers into fewer, larger ones and schedule
them freely. With the next Note's unpinned gathers, on libtpu's schedule of the benchmark's
GPT (v5e-4, AdamW, the defaults) the step's HBM traffic went from 1874 to 1675 MiB and the
estimated step from 3.97 to 2.82 ms at the same peak (``scripts/bench/tpu_levers``' model);
on a Llama 3.2 1B (v5e-8, 2,048 tokens per chip) from 276 to 259 GiB and 744 to 639 ms.

Where the token is on (off a TPU: see the next Note), gathers issued during a backward pass
stay on the chain. A backward gather re-reads a shard that the shard's own gradient does not
depend on (a weight's gradient needs the layer's input, not the weight), so nothing else
orders the optimizer's in-place update of the shard after that read, and XLA:CPU keeps a copy
of every such shard for the step (``tests/_xla/test_donation_order``). On the chain, the
unit's reduce-scatter follows its gather, and the update follows the reduce-scatter.
Reduce-scatters and all-reduces stay on it too. Taken off it, XLA combines a backward's
reduce-scatters, which libtpu lowers to all-reduces of full gradients when the shards are
flat: every unit's full gradient was then held at once (peak 122 -> 142 MiB on the same
step). On the chain they run one at a time, as ZeRO-3's memory needs.

The chain is not what keeps ranks in step. Every rank runs the same program (the virtual
launcher refuses divergent graphs; on a pod each host compiles the same HLO), and XLA's
scheduler is deterministic for a given program, so every rank runs the gathers in the same
order without it. The order FSDP needs (prefetch at most one unit ahead, full parameters
freed after their use) is expressed by data dependencies and optimization barriers, which
hold with or without the token.

[Note: no collective token on a TPU]
The token costs more than its order: adding it is a pass over each collective's input,
every backward gradient before its reduce-scatter included, which libtpu does not fuse into
the matmul that made the gradient. torch_xla 2.9 has one way to issue a layout-pinned
collective without it: its ``DISABLE_NUMERIC_CC_TOKEN`` switch, read when it lowers the
first collective of the process and then holding for every collective, the user's too.
(torch's functional collectives carry no token but pin no layout, and libtpu relays out
their inputs: more traffic than the add, ``docs/tpu_step.md``.) On a TPU the first unit built
sets the switch (``drop_token_on``), unless the environment chose either way; if a
collective was lowered before, the switch is already fixed and a warning says so.

Without the token every rank still issues the same collectives in the same order (the
previous Note), which FSDP's unpinned gathers already rest on (see [Note: defaults that
depend on the hardware] in ``_unit/options``); a script whose ranks trace different steps
keeps the token with ``DISABLE_NUMERIC_CC_TOKEN=0``. What the chain ordered for memory,
libtpu now orders as its schedule sees fit, within the barriers. On a Llama 3.2 1B step
(v5e-8, 2,048 tokens per chip, float32, AdamW, the defaults) libtpu's HBM traffic went from
227.0 to 217.8 GiB and the estimated step from 466 to 453 ms, at the same peak. On the 8B's
shape (v6e-8) libtpu's peak rose from 27.14 to 28.59 GiB of its 31.24, but held to 27.14 it
fits in 25.06: memory the schedule uses because it is free, not memory the program needs
(``docs/tpu_step.md`` has every shape). Other hardware keeps torch_xla's token: nothing was
measured for GPU or Neuron compilers.

[Note: a rank-1 gather needs no pinned layout]
torch_xla pins a collective's layout (``pin_layout=True``, its default) so that ranks whose
programs differ slightly (a line only rank 0 runs, per-rank sequence lengths) cannot lay the
same array out differently and read each other's bytes in another order. A rank-1 array has
one logical layout, and libtpu gives a rank-1 all-gather the same physical one whatever the
program around it: ``T(1024)`` for float32, ``T(1024)(128)(2,1)`` for bf16, pinned or not,
whatever shape the gathered buffer is viewed as and whatever it multiplies (checked on
libtpu's optimized programs for v5e-4). The pin then constrains nothing, but it does decide
the schedule: libtpu runs no pinned all-gather asynchronously. FSDP's gathers of rank-1
pieces (every flat layout's) are therefore unpinned whatever ``pin_layout_in_collective_ops``
says, and a unit's pieces go out as one (coalesced) all-gather; gathers of dim-0 shards (rank
2 and up) and every reduction keep the pin the option asks for, unless the unit coalesces its
gathers (``coalesce_all_gather_ops``, a TPU's default: see [Note: defaults that depend on the
hardware]). On a Llama 3.2 1B step
(v5e-8, 2,048 tokens per chip, the defaults) 15 of 290 pinned gathers overlapped compute;
unpinned one per piece, still 15 of 290 (703 ms estimated); unpinned and coalesced, 75 of
156 (639 ms).
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import (AbstractSet, ContextManager, Dict, List, Optional, Protocol,
                    Sequence, Tuple)

import torch

from .layout import Layout

RankGroups = Optional[List[List[int]]]  # torch_xla's ``groups``: lists of ranks, None for all


class CollectiveBindings(Protocol):
    """torch_xla's bindings that ``Collectives`` needs and may not import."""

    def pinned_all_gathers(self, shards: Sequence[torch.Tensor], shard_count: int,
                           rank_groups: RankGroups, chained: bool) -> List[torch.Tensor]:
        """The pinned native all-gathers of the shards along dim 0, one each, on torch_xla's
        token chain or off it."""

    def off_token_chain(self, device: torch.device) -> ContextManager[None]:
        """Collectives issued inside wait on none before them, nor make later ones wait
        (see [Note: collectives off the token chain])."""

    def collective_token_added(self) -> bool:
        """Whether the collectives lowered from now on add torch_xla's token to their input;
        asking settles it for the process (see [Note: no collective token on a TPU])."""


TOKEN_SWITCH = "DISABLE_NUMERIC_CC_TOKEN"   # torch_xla's


def drop_token_on(hardware: Optional[str], bindings: CollectiveBindings) -> None:
    """Switches torch_xla's collective token off for this process if ``hardware`` is a TPU
    and the environment did not choose (see [Note: no collective token on a TPU])."""
    if hardware != "TPU" or TOKEN_SWITCH in os.environ:
        return
    os.environ[TOKEN_SWITCH] = "1"
    if bindings.collective_token_added():
        warnings.warn(
            f"xla_fsdp: torch_xla lowered a collective before the first FSDP unit was built, "
            f"so its collective token stays on in this process: each collective waits for the "
            f"one before it and makes a pass over its input (docs/tpu_step.md). Set "
            f"{TOKEN_SWITCH}=1 in the environment, or build the model before the first "
            f"collective, to run without it")


class Collectives:
    """Collectives over the ranks of one sharding group, as FSDP uses them."""

    def __init__(self, world_size: int, rank_groups: RankGroups, pin_layout: bool,
                 bindings: CollectiveBindings, rank: int = 0,
                 dummy: AbstractSet[str] = frozenset()) -> None:
        self.world_size = world_size
        self.rank_groups = rank_groups
        self.pin_layout = pin_layout
        self.rank = rank
        # torch_xla's _debug_dummy_*_op switches: local stand-ins with the collectives'
        # shapes, to measure what a step costs without them. Their results are wrong.
        self.dummy = frozenset(dummy)
        self.bindings = bindings

    def all_gather(self, shards: Sequence[torch.Tensor], coalesce: bool,
                   chained: bool = False) -> List[torch.Tensor]:
        """Concatenations along dim 0 of every rank's shard, one per input; on torch_xla's
        token chain only if ``chained`` (see [Note: collectives off the token chain])."""
        import torch_xla.core.xla_model as xm
        if not shards:
            return []
        if "all_gather" in self.dummy:
            return [s.repeat((self.world_size,) + (1,) * (s.dim() - 1)) for s in shards]
        # unpinned when only rank-1 pieces: see [Note: a rank-1 gather needs no pinned layout]
        pinned = self.pin_layout and any(s.dim() > 1 for s in shards)
        if pinned and not (coalesce and len(shards) > 1):
            count = len(self.rank_groups[0]) if self.rank_groups else self.world_size
            return self.bindings.pinned_all_gathers(shards, count, self.rank_groups, chained)
        with contextlib.nullcontext() if chained else \
                self.bindings.off_token_chain(shards[0].device):
            return list(xm.all_gather(list(shards), dim=0, groups=self.rank_groups,
                                      pin_layout=False))

    def reduce_scatter(self, tensors: Sequence[torch.Tensor], scale: float) -> List[torch.Tensor]:
        """Sum over ranks times ``scale``; this rank keeps its dim-0 block of each input.

        Several inputs go out as one reduce-scatter of a single buffer whose row ``r`` holds
        rank ``r``'s block of every input. torch_xla's coalesced (list) reduce-scatter aborts
        the process with ``pin_layout=True`` (torch_xla 2.9, any world size)."""
        import torch_xla.core.xla_model as xm
        if not tensors:
            return []
        n = self.world_size
        buffer = tensors[0] if len(tensors) == 1 else \
            torch.cat([t.reshape(n, -1) for t in tensors], dim=1).reshape(-1)
        if "reduce_scatter" in self.dummy:
            block = buffer.shape[0] // n
            reduced = buffer.narrow(0, self.rank * block, block) * scale
        else:
            reduced = xm.reduce_scatter(xm.REDUCE_SUM, buffer, scale=scale, scatter_dim=0,
                                        shard_count=n, groups=self.rank_groups,
                                        pin_layout=self.pin_layout)
        if len(tensors) == 1:
            return [reduced]
        # Clones, not views: a live view keeps its base alive too, and torch_xla then makes
        # both outputs of the step graph, doubling the gradients' memory.
        sizes = [t.numel() // n for t in tensors]
        return [part.reshape((t.shape[0] // n,) + tuple(t.shape[1:])).clone()
                for part, t in zip(reduced.split(sizes), tensors)]

    def all_to_all(self, tensor: torch.Tensor, split: int, concat: int) -> torch.Tensor:
        """Rank ``j`` gets block ``j`` of ``tensor`` along dim ``split`` from every rank; the
        blocks received are concatenated along dim ``concat`` in the senders' rank order.

        Never pinned: torch_xla lowers a pinned all-to-all to XLA's tuple form, which
        libtpu's StableHLO path cannot legalize (the planner's compile fails), and an
        unpinned one relies on every rank compiling the same program, as FSDP's unpinned
        gathers do (see [Note: defaults that depend on the hardware])."""
        import torch_xla.core.xla_model as xm
        return xm.all_to_all(tensor, split_dimension=split, concat_dimension=concat,
                             split_count=self.world_size, groups=self.rank_groups,
                             pin_layout=False)

    def all_reduce_sum(self, tensor: torch.Tensor,
                       rank_groups: RankGroups = None) -> torch.Tensor:
        return self._all_reduce("sum", tensor, rank_groups)

    def all_reduce_max(self, tensor: torch.Tensor,
                       rank_groups: RankGroups = None) -> torch.Tensor:
        return self._all_reduce("max", tensor, rank_groups)

    def _all_reduce(self, op: str, tensor: torch.Tensor, rank_groups: RankGroups
                    ) -> torch.Tensor:
        import torch_xla.core.xla_model as xm
        if "all_reduce" in self.dummy:
            return tensor.clone()
        return xm.all_reduce(xm.REDUCE_SUM if op == "sum" else xm.REDUCE_MAX, tensor,
                             groups=rank_groups, pin_layout=self.pin_layout)


def optimization_barrier(tensors: Sequence[Optional[torch.Tensor]]) -> None:
    """Stops XLA from fusing or reordering work across this point (e.g. merging a unit's
    forward and backward all-gathers, which keeps its full parameters alive in between)."""
    import torch_xla.core.xla_model as xm
    tensors = [t for t in tensors if t is not None]
    if tensors:
        xm.optimization_barrier_(list(tensors))


def gather_pieces(collectives: Collectives,
                  shards: Sequence[Tuple[Layout, torch.Tensor, torch.dtype]],
                  coalesce: bool, chained: bool = False) -> List[torch.Tensor]:
    """All-gathers the ``pieces`` of (layout, shard, compute dtype) triples, cast to the
    compute dtype first so that low-precision compute moves low-precision bytes: what
    ``layout.unshard_all`` takes."""
    return collectives.all_gather(
        [p for layout, shard, dtype in shards
         for p in layout.pieces(shard if shard.dtype == dtype else shard.to(dtype))],
        coalesce, chained)


def padded_gradient(layout: Layout, grads: Sequence[Optional[torch.Tensor]], dtype: torch.dtype,
                    device: torch.device, fp32_reduce_scatter: bool,
                    divide: Tuple[float, float]) -> torch.Tensor:
    """A shard group's full gradients as the padded tensor its reduce-scatter takes; a
    parameter without a gradient contributes zeros. Low-precision sums are pre-divided for
    headroom."""
    full = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, shape in zip(grads, layout.shapes)]
    flat = layout.pad(full)
    return reduction_input(flat, torch.float32 if fp32_reduce_scatter else flat.dtype,
                           divide)[0]


def reduction_input(flat: torch.Tensor, reduce_dtype: torch.dtype,
                    divide: Tuple[float, float]) -> Tuple[torch.Tensor, float]:
    """A full gradient as its reduce-scatter takes it, in ``reduce_dtype`` and pre-divided,
    and the scale of the reduced shard after (``reduction_divisors``): the eager and the
    traced reductions' one preparation."""
    if flat.dtype != reduce_dtype:
        flat = flat.to(reduce_dtype)
    before, after = reduction_divisors(reduce_dtype, divide)
    return (flat / before if before != 1 else flat), 1.0 / after


def reduction_divisors(dtype: torch.dtype, divide: Tuple[float, float]) -> Tuple[float, float]:
    """(what a full gradient summed in ``dtype`` is divided by before its reduce-scatter,
    what the reduced shard is divided by after it), for the gradient divide factors
    ``divide`` = (pre, post); the one rule of the eager and the traced reductions.

    A low-precision sum is pre-divided for headroom. A float32 sum cannot overflow where
    the pre-division would matter, so its whole division is the reduce-scatter's scale on
    the shard: one pass over the full gradients fewer, and the same bits when both factors
    are powers of two."""
    pre, post = divide
    return (1.0, post * pre) if dtype == torch.float32 else (pre, post)


def scatter_gradients(collectives: Collectives, divide: Tuple[float, float],
                      inputs: List[torch.Tensor], replica_groups: RankGroups,
                      float32: bool = True) -> List[torch.Tensor]:
    """Reduce-scatters ``padded_gradient`` outputs into shard gradients, averaged over the
    ranks (and over the replicas, with ``replica_groups``: hybrid sharding). ``float32``
    casts them for a float32 shard on the device; an offloaded shard's gradient leaves the
    device as it was reduced, in half the bytes when that is bf16, and is cast on the host
    to the same values.

    Inputs of each dtype are reduced together: a float32 input (a module kept in float32
    under bf16 compute) was not pre-divided as a bf16 one was, so its scale after differs
    (``reduction_divisors``), and one coalesced reduce-scatter has one scale."""
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(inputs):
        by_dtype.setdefault(t.dtype, []).append(i)
    outputs: List[torch.Tensor] = [inputs[0]] * len(inputs)
    for dtype, indices in by_dtype.items():
        _, divisor = reduction_divisors(dtype, divide)
        if replica_groups:  # then averaged over the sharding groups too
            divisor *= len(replica_groups[0])
        reduced = collectives.reduce_scatter([inputs[i] for i in indices], scale=1.0 / divisor)
        for i, t in zip(indices, reduced, strict=True):
            outputs[i] = t
    if replica_groups:
        outputs = [collectives.all_reduce_sum(t, replica_groups) for t in outputs]
    return [t if t.dtype == torch.float32 or not float32 else t.float() for t in outputs]


def broadcast_bytes(words: torch.Tensor, pin_layout: bool) -> torch.Tensor:
    """Global rank 0's ``words`` (raw bytes viewed as int32, on the device; the same shape on
    every rank) on every rank: an all-reduce sum to which the other ranks contribute zeros.
    Summing integers, not the values the bytes encode, keeps it exact for every dtype (a
    float sum would turn -0.0 into 0.0); int32, not uint8, because XLA:CPU reduces four
    times fewer elements."""
    import torch_xla.core.xla_model as xm
    if words.dtype != torch.int32:
        raise TypeError(f"broadcast_bytes takes bytes viewed as int32, not {words.dtype}")
    return xm.all_reduce(xm.REDUCE_SUM, words, groups=None, pin_layout=pin_layout)


def sum_over_all_ranks(counts: torch.Tensor) -> torch.Tensor:
    """Every rank's ``counts`` summed, on every rank: an all-reduce over all ranks added to
    the pending graph, so that ranks can agree on a decision without a rendezvous of its own
    (``checkpoint.manager.step_vote``)."""
    import torch_xla.core.xla_model as xm
    return xm.all_reduce(xm.REDUCE_SUM, counts, groups=None, pin_layout=False)
