"""Activation memory of a training step with activation checkpointing: ``checkpoint_module``
(ours) against torch_xla's own ``checkpoint_module`` and against no checkpointing, each block
of the model an FSDP unit.

    python benchmarks/checkpoint_memory.py [--blocks 8] [--batch 512] [--world 2]

XLA:CPU gives no memory statistics at run time, so the figure is XLA's own plan for the
step: each variant's step is compiled with ``--xla_dump_to``, and the largest step graph's
buffer assignment states its temporary allocation (``preallocated-temp``: every
intermediate value, the activations kept for backward among them, packed by XLA's heap
simulation) and its total. The same model, data and optimizer in each variant; one launch
per variant at N = ``--world`` virtual devices, so that each dumps its own graphs.

Needs the installed package (``pip install -e .``). Writes
benchmarks/results/checkpoint_memory.md (``--out`` for another file).
"""
import argparse
import glob
import os
import re
import shutil
import tempfile

import torch

from common import RESULTS, write_result

DIM, HIDDEN = 1024, 4096
VARIANTS = ("no checkpointing", "xla_fsdp checkpoint_module",
            "torch_xla checkpoint_module")


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _step(rank, variant, blocks, batch):
    import torch_xla
    from xla_fsdp import FSDP, checkpoint_module
    from torch_xla.distributed.fsdp.utils import checkpoint_module as torch_xla_checkpoint
    torch.manual_seed(0)
    wrap = {"no checkpointing": lambda m: m, "xla_fsdp checkpoint_module": checkpoint_module,
            "torch_xla checkpoint_module": torch_xla_checkpoint}[variant]
    model = FSDP(torch.nn.Sequential(*[FSDP(wrap(Block())) for _ in range(blocks)]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, DIM, generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = model(x.to(torch_xla.device())).square().mean()
        loss.backward()
        opt.step()
        torch_xla.sync()
        losses.append(loss.item())
    return losses


def _largest_step(directory):
    """(temporary bytes, total bytes) of the dumped graph with the most total bytes."""
    best = (0, 0)
    for path in glob.glob(os.path.join(directory, "*memory-usage-report.txt")):
        text = open(path).read()
        total = int(re.search(r"Total bytes used: (\d+)", text).group(1))
        temp = _temp_bytes(text)
        if total > best[1]:
            best = (temp, total)
    return best


def _temp_bytes(text):
    sizes = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    match = re.search(r"^allocation \d+: size ([\d.]+)(B|KiB|MiB|GiB), preallocated-temp",
                      text, re.M)
    return int(float(match.group(1)) * sizes[match.group(2)]) if match else 0


def main():
    from xla_fsdp import launch
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(RESULTS, "checkpoint_memory.md"))
    args = ap.parse_args()
    rows, losses = [], {}
    for variant in VARIANTS:
        directory = tempfile.mkdtemp()
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={directory} --xla_dump_hlo_as_text"
        try:
            losses[variant] = launch(_step, (variant, args.blocks, args.batch),
                                     num_devices=args.world)[0]
            rows.append((variant, *_largest_step(directory)))
        finally:
            os.environ["XLA_FLAGS"] = flags
            shutil.rmtree(directory, ignore_errors=True)
    activations = args.blocks * args.batch // args.world * (3 * DIM + 2 * HIDDEN) * 4
    lines = [
        "# Activation checkpointing: XLA's memory plan for a training step",
        "",
        f"Command: `python benchmarks/checkpoint_memory.py --blocks {args.blocks} --batch "
        f"{args.batch} --world {args.world}`",
        "",
        f"Model: {args.blocks} residual MLP blocks ({DIM} -> {HIDDEN} -> {DIM}, LayerNorm), "
        f"each an FSDP unit, SGD, a global batch of {args.batch} rows at N = {args.world} "
        f"virtual devices. What one rank's blocks compute per step, forward, about "
        f"{activations / 2**20:,.0f} MiB of activations. Figures are XLA's buffer assignment "
        f"for the largest compiled graph (the step): its temporary allocation (intermediate "
        f"values, the activations kept for backward among them) and its total (with "
        f"parameters and outputs).",
        "",
        "| variant | temporary | total | temporary / no checkpointing |",
        "| --- | --- | --- | --- |",
    ]
    base = rows[0][1]
    for variant, temp, total in rows:
        lines.append(f"| {variant} | {temp / 2**20:,.1f} MiB | {total / 2**20:,.1f} MiB | "
                     f"{temp / base:.2f} |")
    lines += ["", "Losses (2 steps), the same in every variant: " + "; ".join(
        f"{v}: {[round(x, 6) for x in l]}" for v, l in losses.items())]
    write_result(args.out, lines)


if __name__ == "__main__":
    main()
