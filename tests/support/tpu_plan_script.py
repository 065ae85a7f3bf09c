"""A training script as users write one, for ``python -m xla_fsdp.aot`` to plan unchanged:
argparse, ``launch(train, (args,))``, code after the launch that needs its results, and a
``CheckpointManager`` it resumes from (``--ckpt``), as ``examples/train_lm.py`` does."""
import argparse

import torch
import torch.nn as nn


def train(rank: int, args: argparse.Namespace) -> float:
    import torch_xla
    from xla_fsdp import FSDP
    model = FSDP(nn.Sequential(FSDP(nn.Linear(args.dim, 4 * args.dim)), nn.GELU(),
                               FSDP(nn.Linear(4 * args.dim, args.dim))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    if args.ckpt:
        from xla_fsdp.checkpoint import CheckpointManager
        manager = CheckpointManager(args.ckpt, every=None, on_preemption=False)
        if manager.latest() is not None:      # a finished run: nothing left to train
            start = manager.latest()
    for step in range(start, 0 if args.eval_only else args.steps):
        loss = model(torch.randn(8, args.dim).to(torch_xla.device())).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        print(f"step {step} loss {loss.item():.4f}")
    with torch.no_grad():                     # what it does once trained: evaluate
        for _ in range(3):
            loss = model(torch.ones(8, args.dim).to(torch_xla.device())).pow(2).mean()
            torch_xla.sync()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ckpt", help="a CheckpointManager directory to resume from")
    parser.add_argument("--eval-only", action="store_true")
    parser.add_argument("--no-launch", action="store_true")
    args = parser.parse_args()
    if args.no_launch:
        return
    from xla_fsdp import launch
    results = launch(train, (args,))
    print(f"final loss {results[0]:.4f}")


if __name__ == "__main__":
    main()
