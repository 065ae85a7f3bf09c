"""Where one rank's training-step time goes, for one wrapper and setting of the benchmark.

    python -m scripts.bench.step_phases xla_fsdp defaults --devices 4 [--steps 6]

Run from the repository root. Prints rank 0's wall time per step, split into host phases
(tracing forward, backward and the optimizer step; ``sync``, which hashes the graph,
compiles it when new and launches it; ``wait``, which blocks on the result) with
torch_xla's compile and execute metrics for the step (process-wide: every rank's
executions count). A diagnostic, not the benchmark: run it alone, the machine's noise is
the same as for ``python -m scripts.bench``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from xla_fsdp import launch

from .model import IMPLS, SETTINGS, Config, batch, build_model, wrap
from .train import metric

PHASES = ("forward", "backward", "optimizer", "sync", "wait")
METRICS = ("CompileTime", "ExecuteTime")


def run_rank(rank: int, impl: str, setting: str, cfg: Config) -> list:
    import torch_xla
    import torch_xla.core.xla_model as xm
    device = torch_xla.device()
    model = wrap(build_model(cfg), impl, setting)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    torch_xla.sync()
    xm.wait_device_ops()  # wrapping's own graphs are not part of step 1
    rows = []
    for step in range(cfg.steps):
        x, y = (t.to(device) for t in batch(cfg, rank, step))
        before = {m: metric(m) for m in METRICS}
        marks = [time.perf_counter()]
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        optimizer.step()
        marks.append(time.perf_counter())
        torch_xla.sync()
        marks.append(time.perf_counter())
        loss.item()
        marks.append(time.perf_counter())
        row = {p: b - a for p, a, b in zip(PHASES, marks, marks[1:])}
        for m in METRICS:
            count, seconds = (a - b for a, b in zip(metric(m), before[m]))
            row[m] = (count, seconds)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.step_phases",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("impl", choices=IMPLS)
    parser.add_argument("setting", choices=list(SETTINGS))
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    cfg = Config(steps=args.steps)
    rows = launch(run_rank, (args.impl, args.setting, cfg), num_devices=args.devices)[0]
    print(f"{args.impl} {args.setting} N={args.devices}, rank 0, seconds")
    print("step " + " ".join(f"{p:>9}" for p in PHASES) + "     total  compiles (s)"
          "  executions (s)")
    for i, row in enumerate(rows, 1):
        total = sum(row[p] for p in PHASES)
        (nc, tc), (ne, te) = row["CompileTime"], row["ExecuteTime"]
        print(f"{i:>4} " + " ".join(f"{row[p]:9.3f}" for p in PHASES)
              + f" {total:9.3f}  {nc} ({tc:.2f})  {ne} ({te:.2f})")
    steady = rows[3:]
    if steady:
        print("median of steps 4+: " + ", ".join(
            f"{p} {statistics.median(r[p] for r in steady):.3f}" for p in PHASES))


if __name__ == "__main__":
    main()
