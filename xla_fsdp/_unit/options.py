"""The constructor options of an FSDP unit: read from the constructor's arguments, validated
once, and handed whole to auto-wrapped children (torch_xla forgets some of them there).

The constructor keeps torch_xla's signature, whose names are not all the options' names:
some are spelled with a leading underscore (torch_xla's private ones), some set another
option (``mark_step_on_finalization`` is ``sync_on_finalization``, ``on_neuron`` turns on
``shard_param_on_dim_0``, ``_debug_dummy_optimization_barrier_op`` turns the barriers off)
and some default to what the option spells otherwise (``reduce_scatter_bucket_size_mb=None``
is 0, ``compute_dtype=None`` float32, and ``None`` for the options in ``HARDWARE_DEFAULTS``
the hardware's default, see the Note below). ``FsdpOptions.from_arguments`` is the one mapping
from those arguments to options and ``as_arguments`` its inverse, so an option is added
here and in the constructor's signature, nowhere else.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from .._xla.hardware import device_type

COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# [Note: defaults that depend on the hardware]
# An option left at None takes its default from the hardware the unit is built for
# (``_xla.hardware.device_type()``: the runtime's device, or the TPU a plan traces for).
# On a TPU, shards are row blocks of each parameter (``shard_param_on_dim_0``) and a unit's
# pieces go out as one all-gather (``coalesce_all_gather_ops``). libtpu tiles a 2-D array in
# 8 x 128 blocks, so a flat 1-D shard is relaid out into tiles after every gather and out of
# them before every reduce-scatter, a pass over each unit's parameters and gradients; a row
# block already is tiles. The coalesced gather is unpinned (torch_xla has no pinned form of
# it), and libtpu runs only unpinned gathers asynchronously. On a Llama 3.2 1B step (v5e-8,
# 2,048 tokens per chip, AdamW) the HBM traffic went from 258.5 to 227.0 GiB, the collectives
# overlapped with compute from 75 of 302 to 143 of 338, and the estimated step from 639 to
# 574 ms, at the same peak (``docs/tpu_step.md``). Elsewhere the defaults stay torch_xla's:
# flat shards, one gather per piece.
#
# Unpinned gathers of rank-2 pieces rely on every rank compiling the same program, which
# FSDP nearly needs anyway (ranks must issue the same collectives) and the virtual launcher
# checks; the gathered array's layout then comes out the same on every rank. It also comes
# out the same when the programs differ elsewhere: libtpu gave every gathered weight of the
# benchmark's GPT (v5e-4) the same layout at 128 and at 96 tokens per chip, and with the
# loss scaled before backward (84 of 85 gathers; the 85th is the position table, whose
# shape is the sequence length). A script whose ranks trace different steps (a line only
# rank 0 runs inside the step) can still ask for pinned gathers with
# ``coalesce_all_gather_ops=False``.
#
# Checkpoints do not depend on the layout: per-rank files of either load into a model of the
# other (the staging loader), and the same state consolidates to the same outputs
# (``tests/checkpoint/test_roundtrip.py``).
FLAT_DEFAULTS: Dict[str, bool] = {"shard_param_on_dim_0": False, "coalesce_all_gather_ops": False}
HARDWARE_DEFAULTS: Dict[str, Dict[str, bool]] = {
    "TPU": {"shard_param_on_dim_0": True, "coalesce_all_gather_ops": True},
}


def hardware_defaults(hardware: Optional[str]) -> Dict[str, bool]:
    """The hardware-dependent options' defaults on ``hardware`` (torch_xla's device type;
    see [Note: defaults that depend on the hardware])."""
    return dict(HARDWARE_DEFAULTS.get(hardware, FLAT_DEFAULTS))


@dataclass(frozen=True)
class FsdpOptions:
    reshard_after_forward: bool
    flatten_parameters: bool
    execute_sharding_on_init: bool
    optimization_barrier_in_forward: bool
    optimization_barrier_in_backward: bool
    sync_on_finalization: bool
    disable_reshard_on_root: bool
    compute_dtype: torch.dtype
    buffer_dtype: Optional[torch.dtype]   # None: buffers keep their own dtype
    fp32_reduce_scatter: bool
    sharding_groups: Optional[List[List[int]]]
    sharding_rank: Optional[int]
    sharding_world_size: Optional[int]
    replicate_across_groups: bool
    zero_missing_gradients: bool
    offload_optimizer: bool
    vocab_parallel: bool
    shard_param_on_dim_0: bool
    pin_layout_in_collective_ops: bool
    reduce_scatter_bucket_size_mb: int
    coalesce_all_gather_ops: bool
    param_init_fn: Optional[Callable]
    shard_size_multiple: int
    use_xla_patched_linear: bool
    debug_dummy_forward_pass: bool
    debug_msg: str
    debug_print: bool
    debug_dummy_all_gather_op: bool
    debug_dummy_all_reduce_op: bool
    debug_dummy_reduce_scatter_op: bool
    debug_dummy_optimization_barrier_op: bool
    rank: int
    world_size: int

    @staticmethod
    def from_arguments(arguments: Mapping[str, Any]) -> "FsdpOptions":
        """The options ``XlaFullyShardedDataParallel``'s constructor arguments ask for:
        ``arguments`` holds each of its keyword arguments but ``module`` and the auto-wrap
        pair, by torch_xla's name (see the module docstring)."""
        kw = dict(arguments)
        for name in _UNDERSCORED:
            kw[name] = kw.pop("_" + name)
        unset = [name for name in FLAT_DEFAULTS if kw[name] is None]
        if unset:
            defaults = hardware_defaults(device_type())
            kw.update({name: defaults[name] for name in unset})
        mark_step = kw.pop("mark_step_on_finalization")  # torch_xla's older name
        if mark_step is not None:
            kw["sync_on_finalization"] = mark_step
        on_neuron = kw.pop("on_neuron")  # AWS Neuron mishandles flattened parameters
        kw["shard_param_on_dim_0"] = kw["shard_param_on_dim_0"] or on_neuron
        for barrier in ("optimization_barrier_in_forward", "optimization_barrier_in_backward"):
            kw[barrier] = kw[barrier] and not kw["debug_dummy_optimization_barrier_op"]
        kw["reduce_scatter_bucket_size_mb"] = kw["reduce_scatter_bucket_size_mb"] or 0
        kw["compute_dtype"] = kw["compute_dtype"] or torch.float32
        # torch_xla casts buffers to the compute dtype by default, which turns BatchNorm's
        # running statistics (and rotary frequencies) into bf16 accumulators
        for label, dtype in (("compute_dtype", kw["compute_dtype"]),
                             ("buffer_dtype", kw["buffer_dtype"] or kw["compute_dtype"])):
            if dtype not in COMPUTE_DTYPES:
                raise ValueError(f"{label} must be one of {list(COMPUTE_DTYPES)}, got {dtype}")
        rank, world = _resolve_ranks(kw["sharding_groups"], kw["sharding_rank"],
                                     kw["sharding_world_size"])
        if kw["replicate_across_groups"] and kw["sharding_groups"] is None:
            raise ValueError("replicate_across_groups=True needs sharding_groups")
        if kw["shard_size_multiple"] < 1:
            raise ValueError("_shard_size_multiple must be >= 1")
        if kw["vocab_parallel"] and (kw["offload_optimizer"] or kw["replicate_across_groups"]):
            raise ValueError("vocab_parallel=True does not combine with offload_optimizer or "
                             "replicate_across_groups: a vocabulary table's gradient is "
                             "reduced by its lookups' collectives, on the device, within one "
                             "sharding group")
        if kw["debug_dummy_forward_pass"]:
            warnings.warn("_debug_dummy_forward_pass is accepted for compatibility with "
                          "torch_xla and has no effect in xla_fsdp: the real forward runs")
        return FsdpOptions(rank=rank, world_size=world, **kw)

    def as_arguments(self) -> Dict[str, Any]:
        """Constructor arguments that rebuild these options (on an auto-wrapped child):
        ``from_arguments``' inverse."""
        # the values themselves: asdict would deep-copy them, and a param_init_fn bound to
        # an object would reach each auto-wrapped child bound to a copy of it
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        del kw["rank"], kw["world_size"]  # derived from the sharding arguments
        for name in _UNDERSCORED:
            kw["_" + name] = kw.pop(name)
        # the aliases' defaults, which leave the options they alias as they are
        kw.update(mark_step_on_finalization=None, on_neuron=False)
        return kw

    @property
    def replica_groups(self) -> Optional[List[List[int]]]:
        """With ``replicate_across_groups``: the ranks holding the same shard in every
        sharding group, over which gradients are averaged."""
        if not self.replicate_across_groups:
            return None
        sharding = self.sharding_groups
        return [[g[i] for g in sharding] for i in range(len(sharding[0]))]

    @property
    def dummy_collectives(self) -> frozenset:
        """The collectives replaced by local stand-ins of the same shapes (debugging)."""
        return frozenset(op for op in ("all_gather", "all_reduce", "reduce_scatter")
                         if getattr(self, f"debug_dummy_{op}_op"))


# Options spelled with a leading underscore in the constructor (torch_xla's private ones).
_UNDERSCORED = ("shard_size_multiple", "use_xla_patched_linear", "debug_dummy_forward_pass",
                "debug_msg", "debug_print", "debug_dummy_all_gather_op",
                "debug_dummy_all_reduce_op", "debug_dummy_reduce_scatter_op",
                "debug_dummy_optimization_barrier_op")


def _resolve_ranks(rank_groups: Optional[List[List[int]]], rank: Optional[int],
                   world: Optional[int]) -> tuple:
    import torch_xla.runtime as xr
    if rank_groups is None:
        if rank is not None or world is not None:
            raise ValueError("sharding_rank and sharding_world_size only apply together with "
                             "sharding_groups")
        return xr.global_ordinal(), xr.world_size()
    total = xr.world_size()
    members = sorted(r for g in rank_groups for r in g)
    if members != list(range(total)):
        raise ValueError(f"sharding_groups {rank_groups} must contain every rank "
                         f"0..{total - 1} exactly once")
    me = xr.global_ordinal()
    mine = next(g for g in rank_groups if me in g)
    # left out, both follow from the groups: one set of options serves every rank, as a
    # launcher that passes the same arguments to every process (Lightning's) needs
    world = len(mine) if world is None else world
    rank = mine.index(me) if rank is None else rank
    if any(len(g) != world for g in rank_groups):
        raise ValueError(f"every group in sharding_groups {rank_groups} must have "
                         f"sharding_world_size={world} ranks")
    if mine.index(me) != rank:
        raise ValueError(f"sharding_rank={rank} does not match rank {me}'s position "
                         f"{mine.index(me)} in its group {mine}")
    return rank, world


def default_predivide_factor(world_size: int) -> float:
    """torch_xla's predivide factor: doubled from 1 while the factor divides ``world_size``
    and is below ``world_size / factor``, so about its square root, a power of two that need
    not divide it (2 for 3 ranks, 4 for 6). Dividing by it before the reduction keeps
    low-precision sums in range; the postdivide factor is ``world_size`` over it."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)
