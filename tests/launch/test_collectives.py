"""The launcher's collectives are exact at N = 2, 4, 8 over 20 steps.

Inputs are small integers in float32, so every summation order gives the same result and
"exact" means bitwise. Every step draws new inputs, so a collective that met the wrong
step's or the wrong rank's data would show.
"""
import pytest
import torch

from xla_fsdp import launch

STEPS = 20
SIZES = (1, 7, 128, 1000, 4096, 1 << 20)  # 1M elements in the largest


def _inputs(step: int, rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * step + 7919 * rank + numel)
    return torch.randint(-8, 9, (numel,), generator=g).float()


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
    for step in range(STEPS):
        outs, refs = [], []
        for numel in SIZES:
            x = [_inputs(step, r, numel) for r in range(world)]
            mine = x[rank].to(device)
            # all_reduce (sum and scaled mean), world-wide and within groups
            outs.append(xm.all_reduce(xm.REDUCE_SUM, mine, pin_layout=False))
            refs.append(sum(x))
            outs.append(xm.all_reduce(xm.REDUCE_SUM, mine, scale=1.0 / world, pin_layout=False))
            refs.append(sum(x) * (1.0 / world))
            outs.append(xm.all_reduce(xm.REDUCE_MAX, mine, groups=groups, pin_layout=False))
            refs.append(torch.stack([x[r] for r in my_group]).max(0).values)
            # all_gather along dim 0, world-wide and within groups
            outs.append(xm.all_gather(mine, dim=0, pin_layout=False))
            refs.append(torch.cat(x))
            outs.append(xm.all_gather(mine, dim=0, groups=groups, pin_layout=False))
            refs.append(torch.cat([x[r] for r in my_group]))
            # reduce_scatter: every rank gets its slice of the sum
            rows = _rows(numel, world)
            xs = [_inputs(step, r, rows) for r in range(world)]
            outs.append(xm.reduce_scatter(xm.REDUCE_SUM, xs[rank].to(device), scale=1.0,
                                          scatter_dim=0, shard_count=world, pin_layout=False))
            shard = rows // world
            refs.append(sum(xs)[rank * shard:(rank + 1) * shard])
            gsize = len(my_group)
            grows = max(1, numel // gsize) * gsize
            xg = {r: _inputs(step, r, grows) for r in my_group}
            outs.append(xm.reduce_scatter(xm.REDUCE_SUM, xg[rank].to(device), scale=1.0,
                                          scatter_dim=0, shard_count=gsize, groups=groups,
                                          pin_layout=False))
            gi = my_group.index(rank)
            gshard = grows // gsize
            refs.append(sum(xg.values())[gi * gshard:(gi + 1) * gshard])
        # in-place all_reduce of a list of tensors (the form used for gradients)
        listed = [_inputs(step, rank, n).to(device) for n in (3, 300, 3000)]
        xm.all_reduce(xm.REDUCE_SUM, listed, scale=1.0 / world, pin_layout=False)
        for n, t in zip((3, 300, 3000), listed):
            outs.append(t)
            refs.append(sum(_inputs(step, r, n) for r in range(world)) * (1.0 / world))
        torch_xla.sync()
        for out, ref in zip(outs, refs):
            got = out.cpu()
            assert got.shape == ref.shape, (step, got.shape, ref.shape)
            max_error = max(max_error, (got - ref).abs().max().item())
            checked += 1
    return {"max_error": max_error, "checked": checked, "world": world}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow),
                                   pytest.param(8, marks=pytest.mark.slow)])
def test_collectives_exact(world):
    results = launch(run_collectives, num_devices=world)
    assert sorted(results) == list(range(world))
    per_step = len(SIZES) * 7 + 3
    for rank, r in results.items():
        assert r["world"] == world
        assert r["checked"] == STEPS * per_step
        assert r["max_error"] == 0.0, f"rank {rank}: max error {r['max_error']}"
