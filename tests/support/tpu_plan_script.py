"""A training script as users write one, for ``python -m xla_fsdp.aot`` to plan unchanged:
argparse, ``launch(train, (args,))``, and code after the launch that needs its results."""
import argparse

import torch
import torch.nn as nn


def train(rank: int, args: argparse.Namespace) -> float:
    import torch_xla
    from xla_fsdp import FSDP
    model = FSDP(nn.Sequential(FSDP(nn.Linear(args.dim, 4 * args.dim)), nn.GELU(),
                               FSDP(nn.Linear(4 * args.dim, args.dim))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        loss = model(torch.randn(8, args.dim).to(torch_xla.device())).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        print(f"step {step} loss {loss.item():.4f}")
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-launch", action="store_true")
    args = parser.parse_args()
    if args.no_launch:
        return
    from xla_fsdp import launch
    results = launch(train, (args,))
    print(f"final loss {results[0]:.4f}")


if __name__ == "__main__":
    main()
