"""A data-parallel training loop at N = 2, 4, 8 matches N = 1 after 20 steps.

This is the loop that drifted on the prototype launcher. Every rank seeds the global torch
RNG and builds its model and batches from it with no lock: the launcher gives each rank its
own RNG state, as separate processes would have. Each rank trains on its slice of the same
global batch and averages gradients with all_reduce, so every step applies the gradient of
the whole batch and only the order of summation differs from N = 1.
"""
import pytest
import torch

from xla_fsdp import launch
from ..support.checks import nonempty

STEPS = 20
GLOBAL_BATCH = 32


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.up = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 64)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _model():
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(64, 10))


def train_data_parallel(rank: int) -> dict:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    world = xr.world_size()
    device = torch_xla.device()
    torch.manual_seed(0)  # no lock: each rank owns its RNG
    models = {"sgd": _model().to(device), "adamw": _model().to(device)}
    models["adamw"].load_state_dict(models["sgd"].state_dict())
    opts = {"sgd": torch.optim.SGD(models["sgd"].parameters(), lr=0.05, momentum=0.9),
            "adamw": torch.optim.AdamW(models["adamw"].parameters(), lr=1e-3)}
    teacher = torch.randn(64, 10)
    local = GLOBAL_BATCH // world
    losses = {name: [] for name in models}
    for _ in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 64)
        y = (x @ teacher).argmax(-1)  # learnable labels
        xs = x[rank * local:(rank + 1) * local].to(device)
        ys = y[rank * local:(rank + 1) * local].to(device)
        step_losses = {}
        for name, model in models.items():
            opts[name].zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xs), ys)
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / world, pin_layout=False)
            opts[name].step()
            step_losses[name] = xm.all_reduce(xm.REDUCE_SUM, loss.detach(),
                                              scale=1.0 / world, pin_layout=False)
        torch_xla.sync()
        for name, value in step_losses.items():
            losses[name].append(value.item())
    params = {name: {k: v.cpu() for k, v in m.state_dict().items()}
              for name, m in models.items()}
    return {"losses": losses, "params": params}


@pytest.fixture(scope="module")
def reference():
    return launch(train_data_parallel, num_devices=1)[0]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow),
                                   pytest.param(8, marks=pytest.mark.slow)])
def test_matches_single_device(reference, world):
    results = launch(train_data_parallel, num_devices=world)
    for rank in nonempty(range(1, world), "ranks but the first"):  # replicas stay bitwise identical
        for name in ("sgd", "adamw"):
            assert results[rank]["losses"][name] == results[0]["losses"][name]
            for key, value in nonempty(results[rank]["params"][name].items(), "parameters"):
                assert torch.equal(value, results[0]["params"][name][key]), (rank, name, key)
    got = results[0]
    worst = {}
    for name in ("sgd", "adamw"):
        ref_losses = torch.tensor(reference["losses"][name], dtype=torch.float64)
        our_losses = torch.tensor(got["losses"][name], dtype=torch.float64)
        rel = ((our_losses - ref_losses).abs() / ref_losses.abs()).max().item()
        print(f"N={world} {name}: loss rel err {rel:.3g}")
        assert rel <= 1e-6, f"{name}: loss relative error {rel:.3g} at N={world}"
        for key, ref in nonempty(reference["params"][name].items(), "parameters"):
            diff = (got["params"][name][key] - ref).abs().max().item()
            scale = ref.abs().max().item()
            worst[name] = max(worst.get(name, 0.0), diff / max(scale, 1.0))
            assert diff <= 1e-6 * max(scale, 1.0), f"{name} {key}: {diff:.3g} (scale {scale:.3g})"
    print(f"N={world} worst param error / max(|param|, 1): {worst}")
    for name in ("sgd", "adamw"):  # it learns
        assert reference["losses"][name][-1] < 0.9 * reference["losses"][name][0]
