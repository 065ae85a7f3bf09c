"""Every rank owns the process-wide state torch_xla and torch.distributed keep in module
globals, as one process per device would (``launch/virtual/process_globals.py``).

One launch at N = 2 checks all of it: torch.distributed's default group, initialised by
every rank as torch_xla's tests do and used for their collectives, and torch_xla's profiler
step flag under the training loop of torch_xla's examples (``MpDeviceLoader`` +
``xp.StepTrace``).
"""
import pytest
import torch

from xla_fsdp import launch
from ..support.checks import nonempty

STEPS = 5


def per_rank_globals(rank: int) -> dict:
    import threading

    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.profiler as xp
    import torch_xla.distributed.parallel_loader as pl
    from torch._C._distributed_c10d import _resolve_process_group

    rank_thread = threading.get_ident()
    device = torch_xla.device()
    out = {}
    # torch.distributed: shared, the second rank's call failed ("trying to initialize the
    # default process group twice!")
    dist.init_process_group("xla", init_method="xla://")
    world = dist.get_world_size()
    out["dist"] = (dist.get_rank(), world, dist.get_backend(), dist.is_initialized())
    summed = torch.tensor([float(rank + 1)]).to(device)
    dist.all_reduce(summed)
    gathered = [torch.zeros(2, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)).to(device))
    scattered = torch.zeros(2, device=device)
    dist.reduce_scatter(scattered, [torch.full((2,), float(rank + 10 * r)).to(device)
                                    for r in range(world)])
    dist.barrier()
    torch_xla.sync()
    # autograd runs an XLA backward on a thread of its own: hooks there see the rank's world
    # (and find its group by name, as functional collectives do)
    x = torch.ones(3, device=device, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: out.update(in_backward=(
        threading.get_ident() != rank_thread, dist.get_rank(),
        _resolve_process_group(dist.GroupMember.WORLD.group_name).rank())))
    y.sum().backward()
    torch_xla.sync()
    out["all_reduce"] = summed.cpu().tolist()
    out["all_gather"] = [t.cpu().tolist() for t in gathered]
    out["reduce_scatter"] = scattered.cpu().tolist()

    # the profiler's step flag: MpDeviceLoader syncs at its next batch unless a StepTrace
    # marked the step. Shared, one rank cleared another's flag and they synced a different
    # number of times.
    scale = torch.full((1,), float(rank + 1)).to(device)
    loader = pl.MpDeviceLoader([torch.full((4,), float(i)) for i in range(STEPS)], device)
    sums = []
    for step, batch in enumerate(loader):
        with xp.StepTrace("train", step_num=step):
            sums.append(xm.all_reduce(xm.REDUCE_SUM, batch * scale, pin_layout=False))
    out["steps"] = [s.cpu().tolist()[0] for s in sums]
    # a collective after the loop, which a rank one sync behind would leave waiting
    out["after_loop"] = xm.all_reduce(xm.REDUCE_SUM, scale, pin_layout=False).cpu().tolist()

    # each rank destroys its own default group only
    if rank == 0:
        dist.destroy_process_group()
    xm.rendezvous("rank 0 destroyed its default group")
    out["initialized_after_rank_0_destroyed"] = dist.is_initialized()
    if rank != 0:
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results():
    return launch(per_rank_globals, num_devices=2)


def test_every_rank_initialises_and_uses_its_own_default_process_group(results):
    assert sorted(results) == [0, 1]
    for rank, r in nonempty(results.items(), "ranks"):
        assert r["dist"] == (rank, 2, "xla", True)
        assert r["all_reduce"] == [3.0]
        assert r["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert r["reduce_scatter"] == [1.0 + 20.0 * rank] * 2  # (0 + 10 rank) + (1 + 10 rank)
        assert r["in_backward"] == (True, rank, rank)
        assert r["initialized_after_rank_0_destroyed"] == (rank != 0)


def test_step_trace_and_mp_device_loader_sync_alike_on_every_rank(results):
    for r in nonempty(results.values(), "ranks"):
        assert r["steps"] == [3.0 * i for i in range(STEPS)]
        assert r["after_loop"] == [3.0]
