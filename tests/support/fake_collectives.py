"""N ranks of one FSDP unit in one process, without XLA: what the unit-layer tests
(``tests/_unit``) drive ``UnitParams``, ``ShardGroup`` and ``ParamRecord`` with.

``FakeWorld`` shards one copy of a model per rank by the real construction
(``find_parameters``, ``shard_members``) on the CPU, and gives
each rank a ``UnitParams`` whose ``FakeCollectives`` stand for the other ranks:

* its all-gather returns what every rank would have: the concatenation of every rank's
  current shards (cut into the pieces ``gather_pieces`` gathers, in the same order),
  after checking that this rank's inputs are its own;
* its reduce-scatter returns this rank's block of the sum over ranks, where every other
  rank's input is ``peer_scale`` times this rank's: the sum is ``world.sum_factor`` times
  this rank's input, so a test knows the reduced value from its own gradients alone.

Barriers are off in the options (``optimization_barrier`` needs XLA tensors); the tests
check values, so a barrier issued where it should not be fails on the CPU tensors anyway.
"""
import contextlib
import copy
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn as nn

from xla_fsdp._init.find_parameters import find_parameters
from xla_fsdp._init.shard_members import shard_members
from xla_fsdp._sharding.collectives import Collectives, RankGroups
from xla_fsdp._unit.options import FsdpOptions
from xla_fsdp._unit.shard_group import ShardGroup
from xla_fsdp._unit.unit_params import UnitParams

from .checks import nonempty

CPU = torch.device("cpu")


def fsdp_options(world_size: int, rank: int, **overrides) -> FsdpOptions:
    """The constructor's defaults, but barriers off (no XLA here) and ``overrides``."""
    values = dict(
        reshard_after_forward=True, flatten_parameters=False, execute_sharding_on_init=True,
        optimization_barrier_in_forward=False, optimization_barrier_in_backward=False,
        sync_on_finalization=False, disable_reshard_on_root=True, compute_dtype=torch.float32,
        buffer_dtype=None, fp32_reduce_scatter=False, sharding_groups=None, sharding_rank=None,
        sharding_world_size=None, replicate_across_groups=False, zero_missing_gradients=False,
        offload_optimizer=False, vocab_parallel=False,
        shard_param_on_dim_0=False, pin_layout_in_collective_ops=True,
        reduce_scatter_bucket_size_mb=0, coalesce_all_gather_ops=False, param_init_fn=None,
        shard_size_multiple=1, use_xla_patched_linear=True, debug_dummy_forward_pass=False,
        debug_msg="xla_fsdp", debug_print=False, debug_dummy_all_gather_op=False,
        debug_dummy_all_reduce_op=False, debug_dummy_reduce_scatter_op=False,
        debug_dummy_optimization_barrier_op=False, rank=rank, world_size=world_size)
    values.update(overrides)
    return FsdpOptions(**values)


class _NoBindings:
    def pinned_all_gathers(self, shards, count, rank_groups, chained):
        raise AssertionError("FakeCollectives gathers itself")

    def off_token_chain(self, device):
        return contextlib.nullcontext()


class FakeCollectives(Collectives):
    """``Collectives`` of rank ``rank`` among ``world_size`` in one process.

    ``peer_pieces()`` gives, for every rank, the tensors it all-gathers now, in order.
    Every call is logged: ``gathers`` the number of tensors of each all-gather,
    ``reductions`` the (shape, dtype) of each reduce-scatter's inputs and ``scales`` its scale."""

    def __init__(self, world_size: int, rank: int,
                 peer_pieces: Callable[[], List[List[torch.Tensor]]],
                 peer_scale: float = 3.0) -> None:
        super().__init__(world_size, None, pin_layout=False, bindings=_NoBindings(),
                         rank=rank)
        self.peer_pieces = peer_pieces
        self.peer_scale = peer_scale
        self.gathers: List[int] = []
        self.reductions: List[List[tuple]] = []
        self.scales: List[float] = []

    @property
    def sum_factor(self) -> float:
        """The sum over ranks of any reduce-scatter input, over this rank's input."""
        return 1.0 + self.peer_scale * (self.world_size - 1)

    def all_gather(self, shards: Sequence[torch.Tensor], coalesce: bool,
                   chained: bool = False) -> List[torch.Tensor]:
        if not shards:
            return []
        every = self.peer_pieces()
        mine = every[self.rank]
        assert len(mine) == len(shards), (len(mine), len(shards))
        for own, given in zip(nonempty(mine, "shards of this rank"), shards, strict=True):
            assert given.dtype == own.dtype and torch.equal(given, own), \
                "the all-gather's inputs are not this rank's current shards"
        self.gathers.append(len(shards))
        return [torch.cat([pieces[i] for pieces in every]) for i in range(len(shards))]

    def reduce_scatter(self, tensors: Sequence[torch.Tensor], scale: float) -> List[torch.Tensor]:
        if not tensors:
            return []
        n = self.world_size
        self.reductions.append([(t.shape, t.dtype) for t in tensors])
        self.scales.append(scale)
        out = []
        for t in nonempty(tensors, "reduce-scatter inputs"):
            assert t.shape[0] % n == 0, "a reduce-scatter input must cut into equal blocks"
            total = t + sum(t * self.peer_scale for r in range(n) if r != self.rank)
            block = t.shape[0] // n
            out.append(total[self.rank * block:(self.rank + 1) * block] * scale)
        return out

    def all_reduce_sum(self, tensor: torch.Tensor, rank_groups: RankGroups = None
                       ) -> torch.Tensor:
        raise AssertionError("no test here reduces over replicas")


class FakeWorld:
    """``world_size`` copies of ``model`` (which stays as it is: the unwrapped reference),
    each sharded for its rank; ``params[r]`` is rank ``r``'s ``UnitParams`` over its shard
    groups ``shard_groups[r]`` and modules ``modules[r]``, and ``found[r]`` the members
    construction found there (their original parameters, owners and names).

    A world shards the module at ``path`` below each rank's copy. Nested units share their
    copies: the inner unit's world first, then ``FakeWorld(model, modules=inner.modules)``
    shards what the inner one left, as an outer unit's construction does."""

    def __init__(self, model: nn.Module, world_size: int = 2, *,
                 compute_dtype: torch.dtype = torch.float32, peer_scale: float = 3.0,
                 path: str = "", modules: Optional[List[nn.Module]] = None,
                 **option_overrides) -> None:
        self.reference = model
        self.world_size = world_size
        self.modules: List[nn.Module] = []
        self.found: List[list] = []
        self.shard_groups: List[List[ShardGroup]] = []
        self.collectives: List[FakeCollectives] = []
        self.params: List[UnitParams] = []
        for rank in range(world_size):
            options = fsdp_options(world_size, rank, compute_dtype=compute_dtype,
                                   **option_overrides)
            module = copy.deepcopy(model) if modules is None else modules[rank]
            found = find_parameters([(path, module.get_submodule(path))], None)
            shard_groups = shard_members([found], False, options, CPU, type(model).__name__,
                                         lambda owners: compute_dtype).shard_groups
            collectives = FakeCollectives(world_size, rank, self._pieces, peer_scale)
            params = UnitParams(collectives, options, CPU)
            params.add(shard_groups)
            self.modules.append(module)
            self.found.append(found)
            self.shard_groups.append(shard_groups)
            self.collectives.append(collectives)
            self.params.append(params)

    def _pieces(self) -> List[List[torch.Tensor]]:
        return [[p for g in shard_groups
                 for p in g.layout.pieces(g.local().detach().to(g.compute_dtype))]
                for shard_groups in self.shard_groups]

    def reference_params(self, shard_group: ShardGroup) -> List[nn.Parameter]:
        """The unwrapped model's parameters a shard group holds, in its order."""
        return [self.reference.get_parameter(name) for name in shard_group.names]

    def expected_shard(self, shard_group: ShardGroup, full: Sequence[torch.Tensor],
                       rank: int) -> torch.Tensor:
        """``rank``'s shard of the full tensors ``full`` as ``shard_group`` lays them out."""
        return shard_group.layout.shard([t.detach() for t in full], rank)

    def step(self, update: Callable[[torch.Tensor], None], count: bool = True) -> None:
        """An optimizer step on every rank: ``update`` writes each shard in place; with
        ``count`` each shard group counts it (``mark_updated``), as the optimizer guard
        does for torch_xla's foreach kernels, which bump no version counter."""
        for shard_groups in self.shard_groups:
            for g in shard_groups:
                update(g.shard)
                if count:
                    g.mark_updated()


def data_update(value: float) -> Callable[[torch.Tensor], None]:
    """An in-place update invisible to version counters (as torch_xla's foreach kernels)."""
    def update(shard: torch.Tensor) -> None:
        shard.data.add_(value)
    return update


def tracked_update(value: float) -> Callable[[torch.Tensor], None]:
    """An in-place update that bumps the shard's version counter."""
    def update(shard: torch.Tensor) -> None:
        with torch.no_grad():
            shard.add_(value)
    return update
