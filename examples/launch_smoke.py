"""Smoke run of the launcher: data-parallel training on N devices agrees with one device.

    python examples/launch_smoke.py [--devices N] [--steps S]

On a machine without an accelerator the devices are virtual XLA:CPU devices.
"""
import argparse
import time

import torch

from xla_fsdp import launch


def train(rank: int, steps: int) -> list:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    world, device = xr.world_size(), torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 8)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    teacher = torch.randn(32, 8)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32)
        y = (x @ teacher).argmax(-1)
        local = 64 // world
        xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xs.to(device)), ys.to(device))
        loss.backward()
        xm.all_reduce(xm.REDUCE_SUM, [p.grad for p in model.parameters()], scale=1.0 / world,
                      pin_layout=False)
        opt.step()
        mean_loss = xm.all_reduce(xm.REDUCE_SUM, loss.detach(), scale=1.0 / world,
                                  pin_layout=False)
        torch_xla.sync()
        losses.append(mean_loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    start = time.time()
    many = launch(train, (args.steps,), num_devices=args.devices)
    one = launch(train, (args.steps,), num_devices=1)[0]
    worst = max(abs(a - b) / abs(b) for a, b in zip(many[0], one))
    print(f"{len(many)} devices: loss {many[0][0]:.4f} -> {many[0][-1]:.4f}")
    print(f"1 device:  loss {one[0]:.4f} -> {one[-1]:.4f}")
    print(f"largest relative difference over {args.steps} steps: {worst:.2e} "
          f"({time.time() - start:.0f}s)")
    if worst > 1e-6:
        raise SystemExit("data-parallel training did not match one device")


if __name__ == "__main__":
    main()
