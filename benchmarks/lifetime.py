"""What a loop that builds, trains and drops a model leaves behind: live XLA tensors and
host memory after each round, for the unwrapped model, ours and torch_xla's FSDP, in the
same run.

    python benchmarks/lifetime.py [--world 2] [--rounds 20] [--width 512] [--layers 4]

Each round builds a stack of ``--layers`` blocks (two linear layers of ``--width``, one FSDP
unit each, and a root), trains 2 AdamW steps, evaluates once with grad enabled and no
backward, drops model and optimizer, and collects garbage (every rank) before the next
sync. After every round rank 0 reads the live XLA tensors of the process (torch_xla's
``CreateXlaTensor`` less ``DestroyXlaTensor`` counters) and the resident set after
``malloc_trim``. Writes benchmarks/results/lifetime.md.
"""
import argparse
import ctypes
import gc
import os

from common import RESULTS, write_result

KINDS = ("unwrapped", "xla_fsdp", "torch_xla FSDP")


def _rss() -> int:
    import re
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def _live() -> int:
    import torch_xla
    count = torch_xla._XLAC._xla_counter_value
    return (count("CreateXlaTensor") or 0) - (count("DestroyXlaTensor") or 0)


def _model(kind, layers, width, device):
    import torch
    import torch.nn as nn
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
              for _ in range(layers)]
    if kind == "unwrapped":
        return nn.Sequential(*blocks).to(device)
    if kind == "xla_fsdp":
        from xla_fsdp import FSDP
    else:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
    return FSDP(nn.Sequential(*[FSDP(b) for b in blocks]))


def _run(rank, rounds, layers, width):
    import torch
    import torch_xla
    device = torch_xla.device()
    out = {}
    for kind in KINDS:
        torch_xla.sync()
        gc.collect()
        torch_xla.sync()
        start_live, start_rss = _live(), _rss()
        live, rss = [], []
        for _ in range(rounds):
            model = _model(kind, layers, width, device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for _ in range(2):
                model(torch.randn(8, width, device=device)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                torch_xla.sync()
            evaluation = model(torch.randn(8, width, device=device)).sum()
            del model, opt, evaluation
            gc.collect()
            torch_xla.sync()
            live.append(_live() - start_live)
            rss.append(_rss() - start_rss)
        out[kind] = {"live": live, "rss": rss}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(RESULTS, "lifetime.md"))
    args = ap.parse_args()
    from xla_fsdp import launch
    got = launch(_run, (args.rounds, args.layers, args.width), num_devices=args.world)[0]
    params = args.layers * 2 * (args.width * args.width + args.width)
    mib = 2 ** 20
    lines = [
        "# A model built, trained and dropped, round after round",
        "",
        f"Command: `python benchmarks/lifetime.py --world {args.world} --rounds {args.rounds} "
        f"--layers {args.layers} --width {args.width}`",
        "",
        f"{args.layers} blocks of two {args.width}x{args.width} linear layers "
        f"({params * 4 / mib:.1f} MiB of float32 parameters, {params * 12 / mib:.1f} MiB with "
        f"AdamW's state and the gradients), one unit per block and a root; N = {args.world} "
        f"virtual devices in one process, {os.cpu_count()} cores. Each round: build, 2 AdamW "
        f"steps, one evaluation forward without backward, drop, gc.collect(). Figures are "
        f"for the whole process (every rank), after each round, against before the first.",
        "",
        "| model | live XLA tensors after round 1 / 5 / last | host memory added after "
        "round 1 / 5 / last |",
        "| --- | --- | --- |",
    ]
    for kind in KINDS:
        live, rss = got[kind]["live"], got[kind]["rss"]
        pick = [0, min(4, len(live) - 1), len(live) - 1]
        lines.append(f"| {kind} | " + " / ".join(str(live[i]) for i in pick) + " | "
                     + " / ".join(f"{rss[i] / mib:+.0f} MiB" for i in pick) + " |")
    write_result(args.out, lines)


if __name__ == "__main__":
    main()
