"""What user code may do inside ``launch``, and the clear errors it gets when it breaks a rule.

Each misuse costs one short launch at N = 2; everything that must work is batched into one.
"""
import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import torch

from xla_fsdp import LaunchError, launch

from ..support.checks import pairs
from ..support.models import batch, build_model, loss_fn

RPROP_STEPS = 3


def rprop_losses(rank: int, world: int, device) -> list:
    """Each rank's loss over RPROP_STEPS of torch's Rprop on a sharded model."""
    import torch_xla

    from xla_fsdp import FSDP
    torch.manual_seed(0)
    model = FSDP(build_model("net"))
    opt = torch.optim.Rprop(model.parameters(), lr=0.01)
    losses = []
    for step in range(RPROP_STEPS):
        x, y = batch("net", step)
        n = x.shape[0] // world
        opt.zero_grad()
        loss = loss_fn("net", model(x[rank * n:(rank + 1) * n].to(device)),
                       y[rank * n:(rank + 1) * n].to(device))
        loss.backward()
        opt.step()
        torch_xla.sync()
        losses.append(loss.item())
    return losses


def everyday_calls(rank: int, save_path: str) -> dict:
    """Things real training code does that sync implicitly or wait on devices."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = torch_xla.device()
    out = {"rank": xr.global_ordinal(), "world": xr.world_size()}
    # Unseeded draws: each rank has its own RNG, starting where a fresh process would.
    out["draws"] = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
    torch.manual_seed(123)
    out["init"] = torch.nn.Linear(4, 4).weight.detach().clone()
    x = torch.full((4,), float(rank + 1)).to(device)
    total = xm.all_reduce(xm.REDUCE_SUM, x, pin_layout=False)
    out["item"] = total.sum().item()          # implicit sync of a pending collective
    out["branch"] = bool(total[0] > 0)        # data-dependent Python branch
    out["repr"] = repr(total * 2)             # printing a pending collective
    out["float"] = float(xm.all_reduce(xm.REDUCE_MAX, x, pin_layout=False)[0])
    out["cpu"] = (total + 1).cpu().tolist()
    out["gathered"] = xm.all_gather(x, pin_layout=False).cpu().tolist()
    # shapes that depend on a pending collective's values run its graph (torch's Rprop
    # assigns through a boolean mask after data parallelism's gradient all-reduce)
    masked = xm.all_reduce(xm.REDUCE_SUM, x, pin_layout=False) * torch.tensor(
        [1.0, -1.0, 1.0, -1.0]).to(device)
    masked[masked.lt(0)] = 0
    out["masked"] = [masked.cpu().tolist(), torch.nonzero(xm.all_reduce(
        xm.REDUCE_SUM, masked, pin_layout=False)).flatten().cpu().tolist()]
    # ops torch_xla runs on the CPU read a pending collective's values too (Hugging Face's
    # generate calls isin at every token)
    gathered = xm.all_gather(torch.tensor([rank, 1]).to(device), pin_layout=False)
    out["fallbacks"] = [torch.bincount(gathered).cpu().tolist(),
                        torch.isin(gathered, torch.tensor([1]).to(device)).cpu().tolist()]
    # `in` reads it too (Hugging Face's generate checks `pad_token_id in input_ids`)
    contained = xm.all_gather(torch.tensor([rank, 1]).to(device), pin_layout=False)
    out["contains"] = [1 in contained, 5 in contained]
    # ...and torch.nn's that do (their forwards; the backward kernels are out of sight)
    rows = xm.all_gather(torch.full((1, 2), 3.0 + rank).to(device), pin_layout=False)
    ids = torch.tensor([[0, 1]]).to(device)
    out["module_fallbacks"] = [
        torch.nn.functional.embedding_bag(ids, rows.clone()).cpu().tolist(),
        torch.nn.functional.embedding(ids, rows.clone(), max_norm=5.0).cpu().tolist(),
        torch._weight_norm(rows.clone(), torch.ones(2, 1).to(device), 0).cpu().tolist()]
    # ...and on a sharded model, where each rank's mask counts differ (torch's Rprop on
    # FSDP's gradient shards); the counts end up in the graphs of the next collectives
    out["rprop"] = rprop_losses(rank, xr.world_size(), device)
    # pinned (torch_xla's default, as accelerate calls it): rank-specific graphs upstream
    out["pinned"] = [xm.all_gather(x).cpu().tolist(),
                     xm.all_gather(x.reshape(2, 2), dim=1).cpu().tolist()]
    for _ in range(2):  # in-place list all-reduces read back in turn (Fabric's broadcast)
        t = torch.full((3,), float(rank)).to(device)
        xm.all_reduce(xm.REDUCE_SUM, [t], pin_layout=False)
        out.setdefault("in_place", []).append(t.cpu().tolist())
    # waiting with time.sleep for what another rank writes outside any collective
    marker = save_path + ".ready"
    if rank == 1:
        open(marker, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["saw_marker"] = os.path.exists(marker)
    torch_xla.sync(wait=True)
    xm.wait_device_ops()
    out["payloads"] = xm.rendezvous("exchange", f"hello from {rank}".encode())
    # xm.save moves a pending collective's result to the CPU and rendezvouses
    xm.save({"total": xm.all_reduce(xm.REDUCE_SUM, x * 2, pin_layout=False)}, save_path)
    xm.mark_step()
    out["preempted"] = _preempted_through_a_rank_thread(rank)
    return out


def _preempted_through_a_rank_thread(rank: int) -> bool:
    """A SIGTERM the kernel hands to a rank's thread, not the main thread, while a manager
    watches: the preemption flag is set while the ranks still run."""
    from xla_fsdp.checkpoint.manager import preemption
    if rank != 0:
        return False
    preemption.start_watching()   # left on: the flag must not end this worker at its exit
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    deadline = time.monotonic() + 20
    while not preemption.requested() and time.monotonic() < deadline:
        time.sleep(0.05)
    return preemption.requested()


@pytest.mark.slow
def test_everyday_calls_work(tmp_path):
    saved = tmp_path / "saved.pt"
    results = launch(everyday_calls, (str(saved),), num_devices=2)
    assert torch.load(saved)["total"].tolist() == [6.0] * 4
    r0, r1 = results[0], results[1]
    torch.manual_seed(0)  # the unsharded model, trained on the CPU on whole batches
    model = build_model("net")
    opt = torch.optim.Rprop(model.parameters(), lr=0.01)
    assert len(r0["rprop"]) == len(r1["rprop"]) == RPROP_STEPS
    for step, sharded in enumerate(pairs(r0["rprop"], r1["rprop"], what="Rprop losses")):
        x, y = batch("net", step)
        opt.zero_grad()
        loss = loss_fn("net", model(x), y)
        loss.backward()
        opt.step()
        assert abs(sum(sharded) / 2 - loss.item()) <= 1e-5 * loss.item()
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)
    assert r0["draws"] == r1["draws"]
    assert torch.equal(r0["init"], r1["init"])
    for r in (r0, r1):
        assert r["item"] == 12.0
        assert r["branch"] is True
        assert "6." in r["repr"]
        assert r["float"] == 2.0
        assert r["cpu"] == [4.0] * 4
        assert r["gathered"] == [1.0] * 4 + [2.0] * 4
        assert r["masked"] == [[3.0, 0.0, 3.0, 0.0], [0, 2]]
        assert r["fallbacks"] == [[1, 3], [False, True, True, True]]
        assert r["contains"] == [True, False]
        bag, renormed, normed = r["module_fallbacks"]
        assert bag == [[3.5, 3.5]], bag
        torch.testing.assert_close(torch.tensor(renormed),
                                   torch.tensor([[[3.0, 3.0], [20 / 32 ** 0.5] * 2]]))
        torch.testing.assert_close(torch.tensor(normed), torch.full((2, 2), 0.5 ** 0.5))
        assert r["pinned"] == [r["gathered"], [[1.0, 1.0, 2.0, 2.0]] * 2]
        assert r["in_place"] == [[1.0] * 3] * 2
        assert r["saw_marker"]
        assert r["payloads"] == [b"hello from 0", b"hello from 1"]
    assert (r0["preempted"], r1["preempted"]) == (True, False)


def fails_on_rank_one(rank: int) -> None:
    import torch_xla
    for step in range(5):
        if rank == 1 and step == 2:
            raise ValueError(f"boom on rank {rank} at step {step}")
        torch_xla.sync()


def test_rank_failure_releases_everyone_and_names_the_rank():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(fails_on_rank_one, num_devices=4)
    assert time.monotonic() - start < 120
    assert info.value.rank == 1
    assert "boom on rank 1 at step 2" in str(info.value)
    assert "fails_on_rank_one" in str(info.value)  # the remote traceback
    assert isinstance(info.value.__cause__, ValueError)


def aborts_on_rank_one(rank: int) -> None:
    import torch_xla
    torch_xla.sync()
    if rank == 1:
        os.abort()   # as XLA does when a collective times out
    torch_xla.sync()


def test_a_process_killed_by_a_fatal_error_says_where_each_rank_stood():
    with pytest.raises(LaunchError) as info:
        launch(aborts_on_rank_one, num_devices=2)
    message = str(info.value)
    assert "killed by signal SIGABRT" in message
    where = message.split("Where each rank stood (innermost frames first):\n")[1]
    rank0, rank1 = where.split("\n  rank 1: ")
    assert rank0.startswith("  rank 0: File") and "turn_ring.py" in rank0, where
    assert "in aborts_on_rank_one" in rank1.split("\n")[0], where
    assert "Fatal Python error" not in message.split("Last log lines:")[1]


def exits(rank: int, code_on_rank_one) -> int:
    import sys
    import torch_xla
    torch_xla.sync()
    if rank == 1:
        sys.exit(code_on_rank_one)
    return rank


def test_sys_exit_ends_the_rank_as_its_process_would():
    """torch_xla's launcher lets a rank end with sys.exit (its tests end _mp_fn with
    sys.exit(0)): a zero code is a normal end, another one exits the caller with it."""
    assert launch(exits, (0,), num_devices=2) == {0: 0, 1: None}
    with pytest.raises(SystemExit) as info:
        launch(exits, (3,), num_devices=2)
    assert info.value.code == 3


def extra_sync_on_rank_zero(rank: int) -> None:
    import torch_xla
    torch_xla.sync()
    if rank == 0:
        torch_xla.sync()


def test_unmatched_sync_is_reported():
    with pytest.raises(LaunchError) as info:
        launch(extra_sync_on_rank_zero, num_devices=2)
    text = str(info.value)
    assert "ranks reached different collective points" in text
    assert "rank 0: torch_xla.sync()" in text
    assert "rank 1: return from the launched function" in text


def extra_sync_with_nothing_pending(rank: int) -> list:
    import torch_xla
    import torch_xla.core.xla_model as xm
    x = torch.ones(4).to(torch_xla.device())
    torch_xla.sync()
    if rank == 1:
        torch_xla.sync()  # meets rank 0's next sync, whose graph holds an all-reduce
    y = xm.all_reduce(xm.REDUCE_SUM, x, pin_layout=False)
    torch_xla.sync()
    return y.cpu().tolist()


def test_sync_paired_with_a_peer_that_has_nothing_pending_is_reported():
    """Every rank arrives at "torch_xla.sync()", so the points match by kind, and rank 1 had
    nothing to compile: only the graphs each rank ran tell the divergence (before, XLA
    aborted the process after 10 s)."""
    with pytest.raises(LaunchError) as info:
        launch(extra_sync_with_nothing_pending, num_devices=2)
    text = str(info.value)
    assert "from different points of their programs" in text
    assert "rank 0: ran a graph at" in text and "rank 1: had nothing pending at" in text
    assert "test_behaviour.py" in text  # the sites are the user's lines


def rank_baked_into_graph(rank: int) -> float:
    import torch_xla
    import torch_xla.core.xla_model as xm
    x = torch.ones(4).to(torch_xla.device()) * (rank + 1)  # a rank-dependent constant
    y = xm.all_reduce(xm.REDUCE_SUM, x, pin_layout=False)
    torch_xla.sync()
    return y.sum().item()


def test_divergent_graphs_are_reported():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(rank_baked_into_graph, num_devices=2)
    assert time.monotonic() - start < 120
    assert "traced a different graph from rank 0" in str(info.value)


def test_unpicklable_function_is_refused_before_starting():
    with pytest.raises(TypeError, match="picklable"):
        launch(lambda rank: rank, num_devices=2)


def test_bad_device_count():
    with pytest.raises(ValueError, match="num_devices"):
        launch(everyday_calls, ("unused",), num_devices=0)
