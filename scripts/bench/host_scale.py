"""Per-step host cost against depth: the wrapper's overhead at 8, 32 and 64 blocks, unscanned
and scanned, against torch_xla's FSDP.

    python -m scripts.bench.host_scale [--depths 8 32 64] [--devices 2] [--steps 10]

Run from the repository root. One launch per depth runs ``step_phases``' interleaved steps
(``scripts.bench.step_phases.run_rank``) for the unwrapped model, ours (each block a unit),
ours with the blocks one ``ScannedLayers`` unit, and torch_xla's FSDP (each block a unit),
at a width small enough for 64 blocks on two cores. A rank's host time per step is its
thread's CPU time plus that of the autograd engine thread that traces its backward; the
wrapper's overhead is its host time minus the unwrapped model's, from the same steps (the
minimum over the steps after the first three, and the median). Graphs compile with the test
suite's fast XLA flags (``tests/conftest.py``): compilation is not measured here, and
host time does not depend on how well the device code is optimised.

Writes ``benchmarks/results/host_cost/host_scale.{json,md,png}`` (``--out`` for another
directory).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict, replace
from typing import Dict, List
from unittest import mock

from xla_fsdp import launch

from .model import Config
from .report import RESULTS_DIR, machine
from .step_phases import PHASES, WARMUP, run_rank

IMPLS = ("unwrapped", "xla_fsdp", "xla_fsdp_scanned", "torch_xla")
WRAPPERS = IMPLS[1:]
DEFAULTS = dict(dim=256, heads=4, vocab=2048, seq=128, batch=1)
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_llvm_disable_expensive_passes=true")


def host_per_step(rows: List[dict]) -> List[float]:
    return [sum(r[p] for p in PHASES) for r in rows[WARMUP:]]


def summarize(depth: int, rows: Dict[str, List[dict]]) -> dict:
    """Host ms per step per implementation (median and minimum over the steps) and each
    wrapper's overhead over the unwrapped model."""
    out = {"layers": depth}
    for stat_name, stat in (("median", statistics.median), ("min", min)):
        host = {impl: stat(host_per_step(r)) * 1e3 for impl, r in rows.items()}
        out[stat_name] = {"host_ms": host, "overhead_ms": {
            impl: host[impl] - host["unwrapped"] for impl in WRAPPERS if impl in host}}
    return out


def _ratio(summary: dict, stat: str, impl: str) -> str:
    over = summary[stat]["overhead_ms"]
    theirs = over.get("torch_xla")
    return f"{over[impl] / theirs:.2f}" if theirs else "n/a"


def markdown(results: List[dict], cfg: Config, args: argparse.Namespace) -> str:
    lines = ["# Per-step host cost against depth", "",
             f"Machine: {machine()}. Virtual XLA:CPU devices (`xla_fsdp.launch`), N = "
             f"{args.devices}.", "",
             f"Command: `python -m scripts.bench.host_scale --depths "
             f"{' '.join(map(str, args.depths))} --devices {args.devices} --steps "
             f"{args.steps}`", "",
             f"Model: the benchmark's GPT at width {cfg.dim}, {cfg.heads} heads, vocabulary "
             f"{cfg.vocab}, {cfg.batch} sequence(s) of {cfg.seq} tokens per rank, AdamW. "
             f"`xla_fsdp` and `torch_xla`: each block a unit, the rest the root, defaults "
             f"(torch_xla with `pin_layout_in_collective_ops=False`, as in the benchmark); "
             f"`xla_fsdp_scanned`: the blocks one `ScannedLayers` unit, then the root.", "",
             __doc__.split("\n\n")[2].replace("\n", " "), "",
             "Host ms per step per rank (rank 0; its thread plus its backward thread), and "
             "the wrapper's overhead over the unwrapped model from the same launch. "
             "Minimum over the steps (noise on this machine only adds), median in brackets.",
             "",
             "| blocks | unwrapped | xla_fsdp | overhead | xla_fsdp_scanned | overhead | "
             "torch_xla | overhead | ours / torch_xla's overhead | scanned / torch_xla's |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in results:
        cells = [f"{s['min']['host_ms']['unwrapped']:.1f} "
                 f"({s['median']['host_ms']['unwrapped']:.1f})"]
        for impl in WRAPPERS:
            if impl not in s["min"]["host_ms"]:
                cells += ["crashed", ""]
                continue
            cells += [f"{s['min']['host_ms'][impl]:.1f} ({s['median']['host_ms'][impl]:.1f})",
                      f"{s['min']['overhead_ms'][impl]:.1f} "
                      f"({s['median']['overhead_ms'][impl]:.1f})"]
        cells += [f"{_ratio(s, 'min', 'xla_fsdp')} ({_ratio(s, 'median', 'xla_fsdp')})",
                  f"{_ratio(s, 'min', 'xla_fsdp_scanned')} "
                  f"({_ratio(s, 'median', 'xla_fsdp_scanned')})"]
        lines.append(f"| {s['layers']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: List[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    depths = [s["layers"] for s in results]
    for impl in IMPLS:
        axes[0].plot(depths, [s["min"]["host_ms"].get(impl, float("nan")) for s in results],
                     marker="o", label=impl)
    for impl in WRAPPERS:
        axes[1].plot(depths, [s["min"]["overhead_ms"].get(impl, float("nan"))
                              for s in results], marker="o", label=impl)
    axes[0].set_title("host ms per step per rank (min)", fontsize=10)
    axes[1].set_title("wrapper overhead ms (host - unwrapped, min)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("blocks")
        ax.set_xticks(depths)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.host_scale",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "host_cost"))
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed {WARMUP}")
    base = replace(Config(), steps=args.steps, **DEFAULTS)
    results = []
    flags = " ".join(f for f in (os.environ.get("XLA_FLAGS"), FAST_COMPILE) if f)
    for depth in args.depths:
        cfg = replace(base, layers=depth)
        print(f"{depth} blocks ...", flush=True)
        with mock.patch.dict(os.environ, {"XLA_FLAGS": flags}):
            rows = launch(run_rank, (list(IMPLS), "defaults", cfg),
                          num_devices=args.devices)[0]
        results.append(summarize(depth, rows))
        print(json.dumps(results[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_scale.json"), "w") as f:
        json.dump({"config": asdict(base), "devices": args.devices, "steps": args.steps,
                   "results": results}, f, indent=1)
    text = markdown(results, base, args)
    with open(os.path.join(args.out, "host_scale.md"), "w") as f:
        f.write(text)
    plot(results, os.path.join(args.out, "host_scale.png"))
    print(text)


if __name__ == "__main__":
    main()
