"""A shard group with ``offload_optimizer`` (``_unit/host_offload.py``) in a fake world (no
XLA, no launch): the shard is a host tensor of its own, the device copy follows its
generation in the compute dtype, and reduced gradients wait beside the copy until the end
of backward adds them to the host ``.grad``, equal to what the same unit without offload
reduces into its shard."""
import pytest
import torch
from torch.testing import assert_close

from tests.support.fake_collectives import FakeWorld, data_update, tracked_update
from xla_fsdp._unit.host_offload import fetch_gradients

from .test_unit_params import data, expected_grad, model, reference_grads, run_pass, wire
from ..support.checks import nonempty, pairs


@pytest.fixture
def synced(monkeypatch):
    """``torch_xla.sync()`` counted instead of run: nothing here is on an XLA device."""
    import torch_xla
    calls = []
    monkeypatch.setattr(torch_xla, "sync", lambda *a, **k: calls.append(1))
    return calls


def _fetch(world, rank):
    fetch_gradients([(g.shard, g.offload) for g in world.shard_groups[rank]])


@pytest.mark.parametrize("layout", [{}, {"flatten_parameters": True},
                                    {"shard_param_on_dim_0": True}])
def test_the_shard_is_on_the_host_and_its_device_copy_follows_its_generation(layout):
    world = FakeWorld(model(), compute_dtype=torch.bfloat16, offload_optimizer=True, **layout)
    originals = {p.untyped_storage().data_ptr() for p, _, _ in world.found[0]}
    for g in nonempty(world.shard_groups[0], "shard groups"):
        assert g.shard.device.type == "cpu" and g.shard.dtype == torch.float32
        assert g.shard.untyped_storage().data_ptr() not in originals  # never a view
        copy = g.local()
        assert copy.dtype == torch.bfloat16 and copy.requires_grad
        assert_close(copy.float(), g.shard.detach().to(torch.bfloat16).float())
        assert g.local() is copy   # unchanged shard: no new transfer
    for update, count in ((tracked_update(0.5), False), (data_update(0.25), True)):
        before = [g.local() for g in world.shard_groups[0]]
        world.step(update, count=count)
        for g, old in pairs(world.shard_groups[0], before):
            assert g.local() is not old
            assert_close(g.local().float(), g.shard.detach().to(torch.bfloat16).float())


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduced_gradients_reach_the_host_grad_at_the_end_of_backward(rank, dtype, synced):
    plain = FakeWorld(model(), compute_dtype=dtype)
    offloaded = FakeWorld(model(), compute_dtype=dtype, offload_optimizer=True)
    wire(plain.params[rank])
    wire(offloaded.params[rank])
    for step in range(2):
        run_pass(plain, rank, data(step, dtype))
        run_pass(offloaded, rank, data(step, dtype))
        for g in nonempty(offloaded.shard_groups[rank], "shard groups"):
            # as reduced: a bf16 gradient leaves the device in half the bytes
            assert g.device_gradient().dtype == dtype
        _fetch(offloaded, rank)
        assert len(synced) == step + 1   # one execution of the step per backward
        for p, o in pairs(plain.shard_groups[rank], offloaded.shard_groups[rank]):
            assert o.device_gradient() is None
            assert o.shard.grad.device.type == "cpu"
            assert_close(o.shard.grad, p.shard.grad)  # the second backward adds to it
            assert o.shard.grad.dtype == torch.float32
    _fetch(offloaded, rank)
    assert len(synced) == 2, "nothing to fetch: no execution"
    if dtype == torch.float32:
        grads = reference_grads(offloaded, [data(0), data(1)])
        for g in nonempty(offloaded.shard_groups[rank], "offloaded shard groups"):
            assert_close(g.shard.grad, expected_grad(offloaded, g, grads, rank))
