"""The launcher's collectives are exact at N = 2, 4, 8 over 8 steps.

Inputs are small integers in float32, so every summation order gives the same result and
"exact" means bitwise. Every step draws new inputs, so a collective that met the wrong
step's or the wrong rank's data would show.

The expected values are every rank's inputs summed, gathered or maxed on the CPU. The ranks
are threads of one launched process that run Python one at a time, so each step's inputs of
every rank and their sum are drawn once and shared by the ranks (``_everyone``), instead of
eight times over at N = 8, where they were most of the test's time.
"""
import threading

import pytest
import torch

from xla_fsdp import launch

from ..support.checks import nonempty, pairs

STEPS = 8
SIZES = (1, 7, 128, 1000, 4096, 1 << 20)  # 1M elements in the largest


def _inputs(step: int, rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * step + 7919 * rank + numel)
    return torch.randint(-8, 9, (numel,), generator=g).float()


_SHARED = {}   # (step, numel, world) -> (every rank's inputs stacked, their sum)
_SHARED_LOCK = threading.Lock()


def _everyone(step: int, numel: int, world: int):
    """Every rank's ``_inputs(step, r, numel)`` stacked, and their sum: the same for every
    rank, computed by the first that asks (entries of earlier steps are dropped)."""
    key = (step, numel, world)
    with _SHARED_LOCK:
        if key not in _SHARED:
            for old in [k for k in _SHARED if k[0] < step - 1]:
                del _SHARED[old]
            stacked = torch.stack([_inputs(step, r, numel) for r in range(world)])
            _SHARED[key] = (stacked, stacked.sum(0))
        return _SHARED[key]


def _groups(world: int):
    """Two groups at even world size: {0, 2, ...} and {1, 3, ...}."""
    return [list(range(0, world, 2)), list(range(1, world, 2))] if world > 1 else [[0]]


def _rows(numel: int, world: int) -> int:
    return max(1, numel // world) * world  # a multiple of the world size


def run_collectives(rank: int) -> dict:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    world = xr.world_size()
    device = torch_xla.device()
    groups = _groups(world)
    my_group = next(g for g in groups if rank in g)
    max_error = 0.0
    checked = 0
    for step in nonempty(range(STEPS), "steps"):
        outs, refs = [], []
        for numel in SIZES:
            x, total = _everyone(step, numel, world)
            mine = x[rank].to(device)
            # all_reduce (sum and scaled mean), world-wide and within groups
            outs.append(xm.all_reduce(xm.REDUCE_SUM, mine, pin_layout=False))
            refs.append(total)
            outs.append(xm.all_reduce(xm.REDUCE_SUM, mine, scale=1.0 / world, pin_layout=False))
            refs.append(total * (1.0 / world))
            outs.append(xm.all_reduce(xm.REDUCE_MAX, mine, groups=groups, pin_layout=False))
            refs.append(x[my_group].max(0).values)
            # all_gather along dim 0, world-wide and within groups
            outs.append(xm.all_gather(mine, dim=0, pin_layout=False))
            refs.append(x.flatten())
            outs.append(xm.all_gather(mine, dim=0, groups=groups, pin_layout=False))
            refs.append(x[my_group].flatten())
            # reduce_scatter: every rank gets its slice of the sum
            rows = _rows(numel, world)
            xs, xs_total = _everyone(step, rows, world)
            outs.append(xm.reduce_scatter(xm.REDUCE_SUM, xs[rank].to(device), scale=1.0,
                                          scatter_dim=0, shard_count=world, pin_layout=False))
            shard = rows // world
            refs.append(xs_total[rank * shard:(rank + 1) * shard])
            gsize = len(my_group)
            grows = max(1, numel // gsize) * gsize
            xg = _everyone(step, grows, world)[0][my_group]
            outs.append(xm.reduce_scatter(xm.REDUCE_SUM, xg[my_group.index(rank)].to(device),
                                          scale=1.0, scatter_dim=0, shard_count=gsize,
                                          groups=groups, pin_layout=False))
            gi = my_group.index(rank)
            gshard = grows // gsize
            refs.append(xg.sum(0)[gi * gshard:(gi + 1) * gshard])
        # in-place all_reduce of a list of tensors (the form used for gradients)
        listed = [_everyone(step, n, world)[0][rank].to(device) for n in (3, 300, 3000)]
        xm.all_reduce(xm.REDUCE_SUM, listed, scale=1.0 / world, pin_layout=False)
        for n, t in pairs((3, 300, 3000), listed):
            outs.append(t)
            refs.append(_everyone(step, n, world)[1] * (1.0 / world))
        torch_xla.sync()
        for out, ref in pairs(outs, refs):
            got = out.cpu()
            assert got.shape == ref.shape, (step, got.shape, ref.shape)
            if not torch.equal(got, ref):
                error = (got - ref).abs().nan_to_num(nan=float("inf")).max().item()
                max_error = max(max_error, error)
            checked += 1
    return {"max_error": max_error, "checked": checked, "world": world}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow),
                                   pytest.param(8, marks=pytest.mark.slow)])
def test_collectives_exact(world):
    results = launch(run_collectives, num_devices=world)
    assert sorted(results) == list(range(world))
    per_step = len(SIZES) * 7 + 3
    for rank, r in nonempty(results.items(), "ranks"):
        assert r["world"] == world
        assert r["checked"] == STEPS * per_step
        assert r["max_error"] == 0.0, f"rank {rank}: max error {r['max_error']}"
