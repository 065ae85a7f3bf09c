"""Time of ``save_consolidated`` from training code for a model of many small units, where
the cost is in the exchanges between ranks rather than in the bytes: a stack of ``--layers``
bias-free linear layers of ``--width`` squared (one FSDP unit each), AdamW after one step,
N = ``--world`` virtual devices, each format saved ``--repeats`` times after one unrecorded
save.

    python benchmarks/save_consolidated_time.py [--layers 48] [--width 512] [--repeats 5]

Prints, and appends to ``--out`` (by default benchmarks/results/save_consolidated_time.md),
a row per format labelled with ``--label`` (by default the package's git commit), so that
two versions of the package (``PYTHONPATH=<checkout>``) can be set side by side.
"""
import argparse
import os
import statistics
import subprocess
import tempfile
import time

import torch

from common import RESULTS

FORMATS = ("pt", "dcp")


def _run(rank, layers, width, repeats, directory):
    import torch_xla
    from xla_fsdp import FSDP
    from xla_fsdp.checkpoint import save_consolidated
    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(*[FSDP(torch.nn.Linear(width, width, bias=False))
                                       for _ in range(layers)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width).to(torch_xla.device())).sum().backward()
    opt.step()
    torch_xla.sync()
    times = {}
    for fmt in FORMATS:
        for i in range(repeats + 1):
            start = time.perf_counter()
            save_consolidated(os.path.join(directory, f"{fmt}{i}"), model, opt, format=fmt)
            if i:
                times.setdefault(fmt, []).append(time.perf_counter() - start)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=os.path.join(RESULTS, "save_consolidated_time.md"))
    args = ap.parse_args()
    import xla_fsdp
    from xla_fsdp import launch
    package = os.path.dirname(os.path.dirname(os.path.abspath(xla_fsdp.__file__)))
    label = args.label or subprocess.run(["git", "-C", package, "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as directory:
        times = launch(_run, (args.layers, args.width, args.repeats, directory),
                       num_devices=args.world)[0]
    rows = [f"| {label} | {fmt} | {args.layers} x {args.width}x{args.width}, N = {args.world} | "
            f"{statistics.median(t):.3f} s | {', '.join(f'{x:.3f}' for x in t)} |"
            for fmt, t in times.items()]
    print("\n".join(rows))
    with open(args.out, "a") as f:
        f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
