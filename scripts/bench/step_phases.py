"""Where one rank's host time goes in a training step, phase by phase, for several wrappers
of the benchmark's model side by side in one launch.

    python -m scripts.bench.step_phases [unwrapped xla_fsdp torch_xla] [--setting defaults]
        [--devices 2] [--steps 12] [--layers 8]

Run from the repository root. Every wrapper builds its own copy of the model (same weights)
in the same launch; their steps are interleaved (one step of each in turn), so the
machine's load changes hit all of them alike. Per phase, rank 0's CPU time: ``forward``,
``backward`` (the autograd engine's thread for the rank's device, which traces backward
on XLA; see ``train.EngineThread``), ``optimizer`` (AdamW, and the hooks a wrapper runs
around it) and ``sync`` (``torch_xla.sync()``: hashing the graph, compiling it when new,
launching it); then the wall time waiting for the loss. Medians and minima over the steps
after the first three (compilation happens in steps 1 and 2): on a noisy machine the
minimum, which noise can only raise, is the steadier of the two. The wrapper's own host time is its total
minus ``unwrapped``'s. A diagnostic for the per-step host cost, not the benchmark
(``python -m scripts.bench`` runs every competitor in a fresh process).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from xla_fsdp import launch

from .model import IMPLS, SETTINGS, Config, batch, build_model, wrap
from .train import EngineThread

PHASES = ("forward", "backward", "optimizer", "sync")
WARMUP = 3


def run_rank(rank: int, impls: list, setting: str, cfg: Config) -> dict:
    import torch_xla
    import torch_xla.core.xla_model as xm
    device = torch_xla.device()
    runs = {}
    for impl in impls:
        model = wrap(build_model(cfg), impl, setting)
        runs[impl] = (model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), EngineThread())
    torch_xla.sync()
    xm.wait_device_ops()  # wrapping's own graphs are not part of step 1
    rows = {impl: [] for impl in impls}
    for step in range(cfg.steps):
        x, y = (t.to(device) for t in batch(cfg, rank, step))
        for impl, (model, optimizer, engine) in runs.items():
            cpu = [time.thread_time()]
            optimizer.zero_grad(set_to_none=True)
            loss = model(x, y)
            cpu.append(time.thread_time())
            engine.watch(loss)
            backward_cpu = engine.cpu()
            loss.backward()
            backward_cpu = engine.cpu() - backward_cpu
            cpu.append(time.thread_time())
            optimizer.step()
            cpu.append(time.thread_time())
            torch_xla.sync()
            cpu.append(time.thread_time())
            waited = time.perf_counter()
            loss.item()
            waited = time.perf_counter() - waited
            row = dict(zip(PHASES, (b - a for a, b in zip(cpu, cpu[1:]))))
            # the calling thread only waits while the engine's thread traces backward
            row["backward"] += backward_cpu
            row["wait"] = waited
            rows[impl].append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.step_phases",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("impls", nargs="*", metavar="impl",
                        help="unwrapped, xla_fsdp, xla_fsdp_scanned or torch_xla (default: "
                             "unwrapped xla_fsdp torch_xla)")
    parser.add_argument("--setting", choices=list(SETTINGS), default="defaults")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layers", type=int, default=Config.layers)
    args = parser.parse_args()
    args.impls = args.impls or ["unwrapped", *IMPLS]
    unknown = set(args.impls) - {"unwrapped", "xla_fsdp_scanned", *IMPLS}
    if unknown:
        parser.error(f"unknown wrapper(s): {', '.join(sorted(unknown))}")
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed {WARMUP}")
    cfg = replace(Config(), steps=args.steps, layers=args.layers)
    rows = launch(run_rank, (args.impls, args.setting, cfg), num_devices=args.devices)[0]
    print(f"{args.setting}, {args.layers} blocks, N={args.devices}, rank 0, CPU ms per step "
          f"(steps {WARMUP + 1}-{args.steps}); wait is wall ms")
    print(f"{'':>18}" + "".join(f"{p:>10}" for p in PHASES) + f"{'host':>10}{'wrapper':>10}"
          f"{'wait':>10}")
    for label, stat in (("median", statistics.median), ("minimum", min)):
        print(f"{label} over the steps:")
        values = {impl: {p: stat(r[p] for r in impl_rows[WARMUP:]) for p in PHASES + ("wait",)}
                  for impl, impl_rows in rows.items()}
        base = values.get("unwrapped")
        for impl, m in values.items():
            host = sum(m[p] for p in PHASES)
            own = host - sum(base[p] for p in PHASES) if base else float("nan")
            print(f"{impl:>18}" + "".join(f"{m[p] * 1e3:10.1f}" for p in PHASES)
                  + f"{host * 1e3:10.1f}{own * 1e3:10.1f}{m['wait'] * 1e3:10.1f}")

if __name__ == "__main__":
    main()
