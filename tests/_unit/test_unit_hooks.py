"""The hook state machine on its own: two ``HookedUnitState``s (an inner unit around ``first``
and the root around the rest) sharing one ``RootContext``, their hooks on the modules,
over the fake collectives of ``tests/support/fake_collectives.py`` (no XLA, no launch).
A probe inside the model's forward and backward reads, at each point, where every unit
is: its training state, whether its full parameters are gathered, and what it gathered
and reduced so far. Gradients are checked against the unwrapped model's."""
from typing import Callable, Optional

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from tests.support.fake_collectives import CPU, FakeWorld
from xla_fsdp._unit.training_state import TrainingState, TrainingStateError
from xla_fsdp._unit.unit_params import FullParams, UnitParams
from xla_fsdp._unit.unit_hooks import HookedUnitState
from xla_fsdp._unit.unit_state import _STATES
from ..support.checks import every, nonempty

IDLE, FORWARD = TrainingState.IDLE, TrainingState.FORWARD
PRE, POST = TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST
SHARDED, GATHERING, UNSHARDED = FullParams.SHARDED, FullParams.GATHERING, FullParams.UNSHARDED


class Net(nn.Module):
    """``probe(point, tensor)`` runs in forward as the root's compute starts and after
    ``first``, and may hook ``tensor`` for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 3)   # 3 rows: padded at two ranks
        self.probe: Optional[Callable[[str, torch.Tensor], None]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.probe:
            self.probe("root compute", x)
        h = self.first(x)
        if self.probe:
            self.probe("after first", h)
        return self.second(torch.relu(h))


class Units:
    """Rank ``rank``'s two units of a ``Net``, as the wrapper builds them: the inner one
    shards ``first``, the root what is left, and the root adopts the inner one."""

    def __init__(self, rank: int = 0, world_size: int = 2, **options) -> None:
        torch.manual_seed(0)
        self.reference = Net()
        inner = FakeWorld(self.reference, world_size, path="first", **options)
        outer = FakeWorld(self.reference, world_size, modules=inner.modules, **options)
        self.worlds, self.rank = (inner, outer), rank
        self.net = inner.modules[rank]
        self.inner = self._state(inner, self.net.first)
        self.root = self._state(outer, self.net)
        self.root.adopt([self.root, self.inner])
        self.log = []

    def _state(self, world: FakeWorld, member: nn.Module) -> HookedUnitState:
        options = world.params[self.rank].options
        state = HookedUnitState(member, type(member).__name__, [member],
                                UnitParams(world.collectives[self.rank], options, CPU),
                                options, detached=False, first_forward_check=lambda _: None)
        state.add_shard_groups(world.shard_groups[self.rank])
        state.hook_members()
        return state

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The root's forward as the wrapper runs it: a forward that raises settles."""
        try:
            return self.net(x)
        except BaseException:
            self.root.forward_raised()
            raise

    def where(self, point: str) -> None:
        self.log.append((point, self.root.training_state, self.inner.training_state,
                         self.root.params.state, self.inner.params.state,
                         self.gathers(), self.reductions()))

    def gathers(self):
        return tuple(len(w.collectives[self.rank].gathers) for w in self.worlds)

    def reductions(self):
        return tuple(len(w.collectives[self.rank].reductions) for w in self.worlds)

    def probe_backward(self, point: str, tensor: torch.Tensor) -> None:
        """Reads the states at ``point`` in forward, and again when ``tensor``'s gradient
        arrives in backward (after the units' own hooks on it, which came first)."""
        self.where(point)
        if tensor.requires_grad:
            tensor.register_hook(lambda g: self.where(f"grad of {point}"))

    def expected_grads(self, x: torch.Tensor) -> None:
        """Every shard's gradient is its slice of the sum over ranks of the full gradient."""
        ref = Net()
        ref.load_state_dict(self.reference.state_dict())
        ref(x).pow(2).sum().backward()
        for world in nonempty(self.worlds, "worlds"):
            factor = world.collectives[self.rank].sum_factor
            for g in nonempty(world.shard_groups[self.rank], "shard groups"):
                want = world.expected_shard(
                    g, [ref.get_parameter(n).grad * factor for n in g.names], self.rank)
                assert_close(g.shard.grad, want, rtol=1e-6, atol=1e-6)


def x(seed: int = 1) -> torch.Tensor:
    """An input that requires grad, so that the probe also sees the end of backward."""
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def step(units: Units, seed: int = 1) -> None:
    units(x(seed)).pow(2).sum().backward()


def test_a_training_step_walks_both_units_through_their_states():
    units = Units()
    units.net.probe = units.probe_backward
    step(units)
    assert units.log[:3] == [
        # (point, root state, inner state, root params, inner params, gathers, reductions)
        ("root compute", FORWARD, IDLE, UNSHARDED, SHARDED, (0, 1), (0, 0)),
        # the inner unit freed its parameters after its forward; the root keeps its own
        ("after first", FORWARD, IDLE, UNSHARDED, SHARDED, (1, 1), (0, 0)),
        # its outputs' gradient hook gathered the inner unit again; the root's gradients
        # arrived and were reduced first
        ("grad of after first", POST, PRE, SHARDED, UNSHARDED, (2, 1), (0, 2)),
    ]
    # the input's gradient: computed with the inner unit's, which is reducing by then
    assert units.log[3][:3] == ("grad of root compute", POST, POST)
    assert (units.root.training_state, units.inner.training_state) == (IDLE, IDLE)
    assert (units.root.params.state, units.inner.params.state) == (SHARDED, SHARDED)
    units.expected_grads(x(1))


@pytest.mark.parametrize("zero_missing", [True, False])
def test_a_unit_the_backward_reaches_without_gradients_zero_fills_only_if_asked(zero_missing):
    """The inner unit runs without using its weight (a router that chose no expert): its
    output's gradient reaches it, none of its parameters gets one. With
    ``zero_missing_gradients`` it still reduces (zeros), as the ranks that used it do."""
    units = Units(zero_missing_gradients=zero_missing)
    units.net.first.forward = lambda h: torch.cat([h, h[:, :2]], 1)  # 4 -> 6, no weight
    step(units)
    inner = [g.shard.grad for g in units.inner.params.shard_groups]
    if zero_missing:
        assert units.reductions()[0] == len(inner) and every(g is not None and not g.any()
                                                             for g in inner)
    else:
        assert units.reductions()[0] == 0 and every(g is None for g in inner)


def test_a_forward_without_grad_frees_every_unit_root_included():
    units = Units()
    with torch.no_grad():
        units(x())
    assert (units.root.params.state, units.inner.params.state) == (SHARDED, SHARDED)
    assert (units.root.training_state, units.inner.training_state) == (IDLE, IDLE)
    assert every(r.placeholder.shape == (0,) for s in (units.root, units.inner)
                 for g in s.params.shard_groups for r in g.records)


def test_without_reshard_after_forward_the_inner_unit_gathers_once_per_step():
    units = Units()
    units.inner.params.set_reshard_after_forward(False)
    units.net.probe = units.probe_backward
    step(units)
    assert [(p, inner, g) for p, _, _, _, inner, g, _ in units.log] == [
        ("root compute", SHARDED, (0, 1)), ("after first", UNSHARDED, (1, 1)),
        ("grad of after first", UNSHARDED, (1, 1)), ("grad of root compute", UNSHARDED, (1, 1))]
    assert units.inner.params.state is SHARDED  # freed after its backward
    units.expected_grads(x(1))


def test_prefetch_issues_the_next_units_gather_with_this_ones():
    units = Units()
    units.root.set_prefetch(forward=[units.inner])
    units.net.probe = units.probe_backward
    step(units)
    # issued with the root's gather, installed by the inner unit's forward: one gather
    assert units.log[0][4:6] == (GATHERING, (1, 1))
    assert units.log[1][4:6] == (SHARDED, (1, 1))
    units.expected_grads(x(1))


def test_a_forward_that_raised_inside_the_inner_unit_is_settled_as_it_leaves_the_root():
    units = Units()

    def fail(point, tensor):
        if point == "after first":
            # the inner unit's outputs' hook is on `tensor`: a backward would need it
            assert units.inner.params.state is SHARDED
            raise KeyError("user code failed")

    units.net.probe = fail
    with pytest.raises(KeyError):
        step(units)
    assert (units.root.training_state, units.inner.training_state) == (IDLE, IDLE)
    assert (units.root.params.state, units.inner.params.state) == (SHARDED, SHARDED)
    units.net.probe = None
    step(units, seed=2)  # the next step is the one a model that never failed takes
    units.expected_grads(x(2))


def test_a_backward_that_raised_is_settled_at_the_next_forward():
    units = Units()

    def fail_in_backward(point, tensor):
        if point == "after first":
            tensor.register_hook(lambda g: (_ for _ in ()).throw(KeyError("user hook")))

    units.net.probe = fail_in_backward
    with pytest.raises(KeyError):
        step(units)
    # mid-backward: the root reduced, the inner unit gathered for a backward that died
    assert units.root.training_state is POST and units.inner.params.state is UNSHARDED
    units.net.probe = None
    for s in (units.root, units.inner):
        for g in s.params.shard_groups:
            g.shard.grad = None  # optimizer.zero_grad()
    step(units, seed=2)
    units.expected_grads(x(2))
    assert (units.root.training_state, units.inner.training_state) == (IDLE, IDLE)


def test_a_nested_unit_checked_in_the_wrong_state_names_itself():
    units = Units()

    def check(point, tensor):
        if point == "root compute":
            units.root.assert_state([TrainingState.IDLE])

    units.net.probe = check
    with pytest.raises(TrainingStateError, match="FSDP unit around Net is in state FORWARD"):
        step(units)
    # raised inside the root's forward: settled, so the model can be used again
    units.net.probe = None
    step(units)
    units.expected_grads(x(1))


def test_units_are_found_from_their_modules():
    units = Units()
    assert _STATES.get(units.net) is units.root and _STATES.get(units.net.first) is units.inner
    assert _STATES.get(units.net.second) is None
    assert units.root.is_root and not units.inner.is_root
    assert units.inner.context is units.root.context
