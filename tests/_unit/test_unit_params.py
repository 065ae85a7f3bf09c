"""UnitParams on its own: where a unit's full parameters are, and the reduction of its
gradients, with the other ranks of a fake world (``tests/support/fake_collectives.py``: no
XLA, no launch). Every reduced value is checked against the unwrapped model's gradients:
each other rank contributes ``peer_scale`` times this rank's, so a shard's gradient is its
slice of ``sum_factor`` times the full gradient, divided by the divide factors."""
import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from tests.support.fake_collectives import FakeWorld, data_update, tracked_update
from xla_fsdp._unit.unit_params import FullParams
from ..support.checks import every, nonempty, pairs

LAYOUTS = {"flat": {}, "flatten": {"flatten_parameters": True},
           "dim0": {"shard_param_on_dim_0": True}}


class TwoLinears(nn.Module):
    def __init__(self, hidden=6, out=3):  # 3 and the 3-row bias pad at two ranks
        super().__init__()
        self.first = nn.Linear(4, hidden)
        self.second = nn.Linear(hidden, out)

    def forward(self, x, use_second=True):
        h = self.first(x)
        return self.second(torch.relu(h)) if use_second else h


def model(**kwargs):
    torch.manual_seed(0)
    return TwoLinears(**kwargs)


def data(seed, dtype=torch.float32):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(seed)).to(dtype)


def loss(out):
    return out.float().pow(2).sum()


def wire(params, log=None):
    """What the unit's placeholder hooks do (``HookedUnitState._post_accumulate``); returns the
    log of ``post_backward``'s answers, each with ``log()`` after it when given."""
    answers = []

    def arrived(shard_group, index):
        answer = params.post_backward(shard_group, index)
        answers.append(answer if log is None else (answer, log()))

    for g in params.shard_groups:
        for i, r in enumerate(g.records):
            r.hook_gradient(functools.partial(arrived, g, i))
    return answers


def run_pass(world, rank, x, use_second=True, finalize=True):
    params = world.params[rank]
    params.unshard([], barrier=False)
    loss(world.modules[rank](x, use_second)).backward()
    if finalize:
        params.finalize_backward()


def reference_grads(world, inputs, use_second=True, dtype=torch.float32):
    ref = copy.deepcopy(world.reference).to(dtype)
    for x in inputs:
        loss(ref(x, use_second)).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def expected_grad(world, shard_group, grads, rank, divisor=1.0):
    factor = world.collectives[rank].sum_factor / divisor
    return world.expected_shard(shard_group, [grads[n].float() * factor
                                              for n in shard_group.names], rank)


def dummies(params):
    return every(r.placeholder.shape == (0,) and not r.holds_full
                 and not r.placeholder._has_full_param
                 for g in params.shard_groups for r in g.records)


def holds_full_values(world, rank, offset=0.0):
    for g in world.shard_groups[rank]:
        for r, ref in pairs(g.records, world.reference_params(g)):
            want = (ref.detach() + offset).to(g.compute_dtype)
            if not (r.holds_full and r.placeholder._has_full_param
                    and torch.equal(r.placeholder, want)):
                return False
    return True


# -- gathering and freeing ----------------------------------------------------------------------
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_unshard_installs_every_rank_shards_and_reshard_puts_dummies_back(layout, rank):
    world = FakeWorld(model(), **LAYOUTS[layout])
    params, fake = world.params[rank], world.collectives[rank]
    placeholders = [r.placeholder for g in params.shard_groups for r in g.records]
    assert params.state is FullParams.SHARDED and dummies(params) and fake.gathers == []

    assert params.unshard([], barrier=False)
    assert params.state is FullParams.UNSHARDED and holds_full_values(world, rank)
    assert fake.gathers == [sum(len(g.layout.pieces(g.shard)) for g in params.shard_groups)]
    # the modules compute with them: the placeholders are what the modules hold
    assert world.modules[rank].first.weight is placeholders[0]
    x = data(1)
    assert torch.equal(world.modules[rank](x), world.reference(x))

    assert not params.unshard([], barrier=False)  # current already: nothing gathered
    assert len(fake.gathers) == 1

    params.reshard(params.shard_groups, [], barrier=False)
    assert params.state is FullParams.SHARDED and dummies(params)
    assert [id(r.placeholder) for g in params.shard_groups for r in g.records] == \
        [id(p) for p in placeholders]  # the same tensors, for the modules and autograd
    params.unshard([], barrier=False)
    assert len(fake.gathers) == 2 and holds_full_values(world, rank)


def test_low_precision_compute_gathers_and_frees_in_the_compute_dtype():
    world = FakeWorld(model(), compute_dtype=torch.bfloat16)
    params = world.params[1]
    assert every(g.shard.dtype == torch.float32 for g in params.shard_groups)
    params.unshard([], barrier=False)
    assert holds_full_values(world, 1)  # compared in bfloat16
    assert every(r.placeholder.dtype == torch.bfloat16 for g in params.shard_groups
                 for r in g.records)
    params.reshard(params.shard_groups, [], barrier=False)
    assert dummies(params) and every(r.placeholder.dtype == torch.bfloat16
                                     for g in params.shard_groups for r in g.records)


def test_resharding_some_shard_groups_keeps_the_others_gathered():
    world = FakeWorld(model())
    params = world.params[0]
    first, *rest = params.shard_groups
    params.unshard([], barrier=False)
    params.reshard([first], [], barrier=False)
    assert params.state is FullParams.UNSHARDED
    assert not first.records[0].holds_full and first.records[0].placeholder.shape == (0,)
    assert every(r.holds_full for g in rest for r in g.records)
    params.reshard(rest, [], barrier=False)
    assert params.state is FullParams.SHARDED and dummies(params)


def test_a_prefetch_is_issued_with_the_unshard_and_installed_by_the_next():
    world, other = FakeWorld(model()), FakeWorld(model(hidden=7))
    a, b = world.params[1], other.params[1]
    assert a.unshard([], barrier=False, prefetch=[b])
    assert a.state is FullParams.UNSHARDED
    assert b.state is FullParams.GATHERING and len(other.collectives[1].gathers) == 1
    assert dummies(b)  # issued, not installed

    assert b.unshard([], barrier=False)
    assert b.state is FullParams.UNSHARDED and holds_full_values(other, 1)
    assert len(other.collectives[1].gathers) == 1  # the prefetched gather, not another

    # both current: a prefetch gathers nothing
    a.unshard([], barrier=False, prefetch=[b])
    assert len(world.collectives[1].gathers) == 1 and len(other.collectives[1].gathers) == 1


def test_a_dropped_prefetch_is_gathered_again_and_drop_leaves_full_parameters_alone():
    world, other = FakeWorld(model()), FakeWorld(model(hidden=7))
    a, b = world.params[0], other.params[0]
    a.unshard([], barrier=False, prefetch=[b])
    b.drop_prefetch()
    assert b.state is FullParams.SHARDED and dummies(b)
    b.unshard([], barrier=False)
    assert len(other.collectives[0].gathers) == 2 and holds_full_values(other, 0)

    a.drop_prefetch()  # nothing in flight: the installed parameters stay
    assert a.state is FullParams.UNSHARDED and holds_full_values(world, 0)


def test_a_backward_that_never_reached_the_unit_drops_its_prefetch():
    world, other = FakeWorld(model()), FakeWorld(model(hidden=7))
    a, b = world.params[0], other.params[0]
    b.set_reshard_after_backward(False)  # what b gathered, it would keep
    a.unshard([], barrier=False, prefetch=[b])
    b.finalize_backward()
    assert b.state is FullParams.SHARDED and other.collectives[0].reductions == []
    assert every(g.shard.grad is None for g in b.shard_groups)


# -- stale generations ---------------------------------------------------------------------------
@pytest.mark.parametrize("update, counted", [(data_update(0.5), True),
                                             (tracked_update(0.5), False)],
                         ids=["counted step", "in-place write"])
def test_full_parameters_kept_after_backward_are_gathered_again_after_a_step(update, counted):
    world = FakeWorld(model())
    params, fake = world.params[1], world.collectives[1]
    params.set_reshard_after_backward(False)
    wire(params)
    run_pass(world, 1, data(1))
    assert params.state is FullParams.UNSHARDED and len(fake.gathers) == 1
    params.unshard([], barrier=False)
    assert len(fake.gathers) == 1  # unchanged shards: the held values are current

    world.step(update, count=counted)
    params.unshard([], barrier=False)
    assert len(fake.gathers) == 2 and holds_full_values(world, 1, offset=0.5)
    x = data(2)
    assert_close(world.modules[1](x), _shifted(world.reference, 0.5)(x))


def test_a_prefetch_issued_before_a_step_is_not_installed():
    world, other = FakeWorld(model()), FakeWorld(model(hidden=7))
    a, b = world.params[0], other.params[0]
    a.unshard([], barrier=False, prefetch=[b])
    other.step(data_update(-1.0))  # a load, say, between the prefetch and b's forward
    b.unshard([], barrier=False)
    assert len(other.collectives[0].gathers) == 2 and holds_full_values(other, 0, offset=-1.0)


def _shifted(module, offset):
    out = copy.deepcopy(module)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(offset)
    return out


# -- reduction ----------------------------------------------------------------------------------
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_shard_gets_its_slice_of_the_summed_gradients_divided(layout, rank):
    world = FakeWorld(model(), **LAYOUTS[layout])
    params, fake = world.params[rank], world.collectives[rank]
    params.set_divide(2.0, 4.0, world_size=2)
    answers = wire(params)
    x = data(1)
    run_pass(world, rank, x, finalize=False)
    # each shard group is reduced as soon as its gradients are complete (bucket size 0)
    assert len(fake.reductions) == len(params.shard_groups)
    assert answers[-1] and not any(answers[:-1])  # the unit's last shard group says so
    assert params.state is FullParams.SHARDED and dummies(params)  # each freed once reduced
    params.finalize_backward()
    assert len(fake.reductions) == len(params.shard_groups)
    assert fake.scales == [1 / 8] * len(params.shard_groups)
    grads = reference_grads(world, [x])
    for g in nonempty(params.shard_groups, "shard groups"):
        assert g.shard.grad.dtype == torch.float32
        assert_close(g.shard.grad, expected_grad(world, g, grads, rank, divisor=8.0))
        assert every(r.placeholder.grad is None for r in g.records)
    assert params.state is FullParams.SHARDED and dummies(params)


def test_a_reduced_gradient_adds_to_the_shard_gradient():
    world = FakeWorld(model())
    params = world.params[1]
    wire(params)
    x1, x2 = data(1), data(2)
    run_pass(world, 1, x1)
    run_pass(world, 1, x2)  # no zero_grad in between: gradients accumulate
    grads = reference_grads(world, [x1, x2])
    for g in nonempty(params.shard_groups, "shard groups"):
        assert_close(g.shard.grad, expected_grad(world, g, grads, 1))


@pytest.mark.parametrize("fp32_reduce_scatter", [False, True])
def test_low_precision_gradients_are_pre_divided_or_reduced_in_float32(fp32_reduce_scatter):
    world = FakeWorld(model(), compute_dtype=torch.bfloat16,
                      fp32_reduce_scatter=fp32_reduce_scatter)
    params, fake = world.params[1], world.collectives[1]
    params.set_divide(2.0, 4.0, world_size=2)
    wire(params)
    x = data(1, torch.bfloat16)
    run_pass(world, 1, x)
    want_dtype = torch.float32 if fp32_reduce_scatter else torch.bfloat16
    assert every(dtype == want_dtype for call in fake.reductions for _, dtype in call)
    # float32 sums take the whole division as the reduce-scatter's scale; bfloat16 ones
    # were divided by the pre factor before it, for headroom
    assert fake.scales == [1 / 8 if fp32_reduce_scatter else 1 / 4] * len(fake.scales)
    grads = reference_grads(world, [x], dtype=torch.bfloat16)
    for g in nonempty(params.shard_groups, "shard groups"):
        assert g.shard.grad.dtype == torch.float32
        assert_close(g.shard.grad, expected_grad(world, g, grads, 1, divisor=8.0),
                     rtol=2e-2, atol=1e-3)


def test_reduce_scatters_are_bucketed_by_size():
    # shard groups of 64 B, 16 B, 1.12 MB and 280 kB: a 1 MB bucket fills at the third
    big = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 70_000))
    for bucket_mb, calls in ((1, [3, 1]), (0, [1, 1, 1, 1])):
        world = FakeWorld(big, reduce_scatter_bucket_size_mb=bucket_mb)
        params, fake = world.params[1], world.collectives[1]
        params.unshard([], barrier=False)
        grads = _give_gradients(params)
        for g in params.shard_groups:  # in shard group order, whatever autograd's order
            for i in range(len(g.records)):
                params.post_backward(g, i)
        params.finalize_backward()
        assert [len(call) for call in fake.reductions] == calls
        for g in nonempty(params.shard_groups, "shard groups"):
            assert_close(g.shard.grad, expected_grad(world, g, grads, 1))


def test_an_immediate_pass_holds_its_reductions_until_the_units_last_then_issues_them():
    """Between compiled regions (see [Note: FSDP's hooks under torch.compile]) a unit's
    reduce-scatters wait for its last shard group, then go out together, whatever the
    bucket size (0 here: one call per shard group otherwise)."""
    world = FakeWorld(model(), reduce_scatter_bucket_size_mb=0)
    params, fake = world.params[0], world.collectives[0]
    params.set_immediate(True)
    answers = wire(params, log=lambda: [len(call) for call in fake.reductions])
    x = data(1)
    run_pass(world, 0, x, finalize=False)
    n = len(params.shard_groups)
    assert len(answers) == sum(len(g.records) for g in params.shard_groups) > 1
    assert answers[:-1] == [(False, [])] * (len(answers) - 1)   # none issued before the last
    assert answers[-1] == (True, [n])                          # then all, as one call
    params.finalize_backward()
    assert len(fake.reductions) == 1  # nothing left to reduce
    grads = reference_grads(world, [x])
    for g in nonempty(params.shard_groups, "shard groups"):
        assert_close(g.shard.grad, expected_grad(world, g, grads, 0))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_gradients_that_require_grad_are_refused():
    world = FakeWorld(model())
    wire(world.params[0])
    world.params[0].unshard([], barrier=False)
    with pytest.raises(RuntimeError, match="create_graph"):
        loss(world.modules[0](data(1))).backward(create_graph=True)


def _give_gradients(params):
    """Known full gradients on the placeholders (which must hold full values)."""
    grads = {}
    gen = torch.Generator().manual_seed(7)
    for g in params.shard_groups:
        for name, r in pairs(g.names, g.records):
            grads[name] = torch.randn(r.placeholder.shape, generator=gen)
            r.placeholder.grad = grads[name].clone()
    return grads


# -- no_sync ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_no_sync_gradients_stay_on_placeholders_until_a_synced_reduction_adds_them(layout):
    world = FakeWorld(model(), **LAYOUTS[layout])
    params, fake = world.params[1], world.collectives[1]
    wire(params)
    x1, x2 = data(1), data(2)
    params.set_sync_gradients(False)
    run_pass(world, 1, x1, finalize=False)
    assert fake.reductions == []
    assert params.state is FullParams.SHARDED and dummies(params)  # each freed once complete
    params.finalize_backward()
    first = reference_grads(world, [x1])
    for g in nonempty(params.shard_groups, "shard groups"):
        for name, r in pairs(g.names, g.records):
            assert_close(r.placeholder.grad, first[name])
        # the accumulation is marked: a zero shard gradient the next reduction adds to
        assert g.sentinel is not None and g.accumulating()
        assert torch.equal(g.shard.grad, torch.zeros_like(g.shard))

    params.set_sync_gradients(True)
    run_pass(world, 1, x2)
    both = reference_grads(world, [x1, x2])
    for g in nonempty(params.shard_groups, "shard groups"):
        assert g.sentinel is None and every(r.placeholder.grad is None for r in g.records)
        assert_close(g.shard.grad, expected_grad(world, g, both, 1))


def test_no_sync_keeps_full_parameters_a_unit_keeps_after_forward():
    world = FakeWorld(model(), reshard_after_forward=False)
    params = world.params[0]
    wire(params)
    params.set_sync_gradients(False)
    run_pass(world, 0, data(1))
    assert params.state is FullParams.UNSHARDED and holds_full_values(world, 0)
    params.set_sync_gradients(True)
    run_pass(world, 0, data(2))
    assert params.state is FullParams.SHARDED and dummies(params)


@pytest.mark.parametrize("took_part", [True, False])
def test_an_accumulation_is_reduced_when_the_synced_backward_skips_it(took_part):
    world = FakeWorld(model())
    params = world.params[1]
    wire(params)
    x1, x2 = data(1), data(2)
    params.set_sync_gradients(False)
    run_pass(world, 1, x1)                                  # uses `second`
    params.set_sync_gradients(True)
    if took_part:
        run_pass(world, 1, x2, use_second=False)            # skips `second`
    else:
        params.finalize_backward()           # never reaches the unit
    ref = copy.deepcopy(world.reference)
    loss(ref(x1)).backward()
    if took_part:
        loss(ref(x2, False)).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for g in nonempty(params.shard_groups, "shard groups"):
        assert g.sentinel is None and every(r.placeholder.grad is None for r in g.records)
        assert_close(g.shard.grad, expected_grad(world, g, grads, 1))


@pytest.mark.parametrize("zero_grad", ["set_to_none", "zero_"])
def test_an_accumulation_whose_shard_gradient_was_dropped_is_dropped(zero_grad):
    world = FakeWorld(model())
    params = world.params[1]
    wire(params)
    x1, x2 = data(1), data(2)
    params.set_sync_gradients(False)
    run_pass(world, 1, x1)
    params.drop_abandoned()  # the shard gradients are the accumulation's: nothing dropped
    assert every(g.accumulating() and r.placeholder.grad is not None
                 for g in params.shard_groups for r in g.records)

    for g in params.shard_groups:  # optimizer.zero_grad(set_to_none=...)
        if zero_grad == "set_to_none":
            g.shard.grad = None
        else:
            g.shard.grad.zero_()
    params.drop_abandoned()
    assert every(g.sentinel is None and r.placeholder.grad is None
                 for g in params.shard_groups for r in g.records)

    params.set_sync_gradients(True)
    run_pass(world, 1, x2)
    second = reference_grads(world, [x2])
    for g in nonempty(params.shard_groups, "shard groups"):
        assert_close(g.shard.grad, expected_grad(world, g, second, 1))


# -- when a shard group is reduced --------------------------------------------------------------
def test_a_shard_group_is_reduced_once_every_trainable_record_has_its_gradient():
    world = FakeWorld(model(), flatten_parameters=True)
    params, fake = world.params[0], world.collectives[0]
    (g,) = params.shard_groups
    params.unshard([], barrier=False)
    _give_gradients(params)
    assert [params.post_backward(g, i) for i in (2, 0, 0, 3)] == [False] * 4
    assert fake.reductions == []
    assert params.post_backward(g, 1)  # complete: reduced, the unit's last
    assert len(fake.reductions) == 1
    params.finalize_backward()
    assert len(fake.reductions) == 1               # nothing arrived since

    g.records[1].agree_requires_grad(False)        # frozen since: no gradient to wait for
    params.unshard([], barrier=False)
    _give_gradients(params)
    assert [params.post_backward(g, i) for i in (0, 2)] == [False, False]
    assert params.post_backward(g, 3) and len(fake.reductions) == 2


def test_a_gradient_arriving_after_its_shard_groups_reduction_is_reduced_at_the_end():
    world = FakeWorld(model(), flatten_parameters=True)
    params, fake = world.params[0], world.collectives[0]
    (g,) = params.shard_groups
    params.set_reshard_after_backward(False)
    params.unshard([], barrier=False)
    _give_gradients(params)
    for i in range(4):
        params.post_backward(g, i)
    g.records[0].placeholder.grad = torch.ones_like(g.records[0].placeholder)  # used again
    assert not params.post_backward(g, 0) and len(fake.reductions) == 1
    params.finalize_backward()
    assert len(fake.reductions) == 2
    params.finalize_backward()       # the next backward starts afresh
    assert len(fake.reductions) == 2


# -- parameters without a gradient --------------------------------------------------------------
@pytest.mark.parametrize("zero_missing", [False, True])
def test_shard_groups_without_a_gradient(zero_missing):
    frozen = model()
    frozen.second.bias.requires_grad_(False)
    world = FakeWorld(frozen, zero_missing_gradients=zero_missing)
    params, fake = world.params[1], world.collectives[1]
    wire(params)
    x = data(1)
    run_pass(world, 1, x, use_second=False, finalize=False)  # `second` skipped
    # zero-filled: nothing is reduced before the end of backward, then every trainable
    # shard group in shard group order, on every rank alike
    assert len(fake.reductions) == (0 if zero_missing else 2)
    params.finalize_backward()
    first_w, first_b, second_w, second_b = params.shard_groups
    padded = [(g.layout.pad([torch.zeros(s) for s in g.layout.shapes]).shape, torch.float32)
              for g in (first_w, first_b, second_w)]
    issued = [call for call, in fake.reductions]
    if zero_missing:
        assert issued == padded
    else:  # in the order autograd delivered them
        assert sorted(issued, key=str) == sorted(padded[:2], key=str)
    grads = reference_grads(world, [x], use_second=False)
    for g in (first_w, first_b):
        assert_close(g.shard.grad, expected_grad(world, g, grads, 1))
    if zero_missing:
        assert torch.equal(second_w.shard.grad, torch.zeros_like(second_w.shard))
    else:
        assert second_w.shard.grad is None
    assert second_b.shard.grad is None  # frozen: never reduced
    assert params.state is FullParams.SHARDED


# -- a pass that raised -------------------------------------------------------------------------
def test_abandon_drops_the_queue_the_full_parameters_and_the_gather_in_flight():
    world, other = FakeWorld(model()), FakeWorld(model(hidden=7))
    a, b = world.params[1], other.params[1]
    fake = world.collectives[1]
    a.unshard([], barrier=False, prefetch=[b])
    _give_gradients(a)
    first = a.shard_groups[0]
    a.set_immediate(True)
    a.post_backward(first, 0)   # complete: queued, held
    a.set_immediate(False)
    # ... the backward raised here: the other shard groups have gradients, unreduced
    a.abandon()
    b.abandon()
    assert a.state is FullParams.SHARDED and dummies(a)
    assert b.state is FullParams.SHARDED and dummies(b)
    assert every(r.placeholder.grad is None for g in a.shard_groups for r in g.records)
    a.run_reductions()
    a.finalize_backward()  # nothing of the pass that raised is left to reduce
    assert fake.reductions == [] and every(g.shard.grad is None for g in a.shard_groups)

    # the next pass is the one a model that never saw the error would take
    wire(a)
    x = data(3)
    run_pass(world, 1, x)
    assert len(fake.gathers) == 2
    b.unshard([], barrier=False)
    assert len(other.collectives[1].gathers) == 2 and holds_full_values(other, 1)
    grads = reference_grads(world, [x])
    for g in nonempty(a.shard_groups, "shard groups"):
        assert_close(g.shard.grad, expected_grad(world, g, grads, 1))
