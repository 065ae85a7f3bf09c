"""Depth sweep: compile and step time against the number of blocks, scanned and not.

    python -m scripts.bench.depth [--depths 4 16 64] [--devices 4] [--repeats 2]

Run from the repository root. The GPT, batches, AdamW and measurements of
``python -m scripts.bench`` (``scripts.bench.measure.measure``: every run a fresh process,
the order alternating between repetitions, one extra inspection run per variant for XLA's
memory statistics), at a width small enough for 64 blocks on two cores.

Variants:

- ``xla_fsdp``: ours, each block an FSDP unit, the rest the root (as in
  ``python -m scripts.bench``);
- ``xla_fsdp_scanned``: ours, ``model.blocks = ScannedLayers(model.blocks)`` (one unit run
  as one XLA while loop), then the root; "unavailable" while ``xla_fsdp`` has no
  ``ScannedLayers``;
- ``fsdpv2``: torch_xla's SPMD FSDPv2, each block wrapped, then the root;
- ``fsdpv2_scan``: FSDPv2 with ``torch_xla.experimental.scan_layers`` over the blocks (see
  ``scripts/bench/spmd.py`` for how the blocks are wrapped).

Writes ``benchmarks/results/depth/depth_sweep.{json,md,png}`` (``--out`` for another
directory).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, replace
from typing import Dict, List, Optional

from .measure import measure
from .model import Config
from .report import (MB, PHASES_TEXT, RESULTS_DIR, SPMD_MEMORY_TEXT, machine,
                     with_estimates)

VARIANTS = ("xla_fsdp", "xla_fsdp_scanned", "fsdpv2", "fsdpv2_scan")
DEFAULTS = dict(dim=256, heads=4, vocab=2048, seq=64, batch=1, steps=6)
# (label, key, scale, format) of the per-depth table
COLUMNS = [("time to first step from process start (s)", "startup_seconds", 1, ".1f"),
           ("first step (s)", "first_step_seconds", 1, ".2f"),
           ("compile time (s)", "compile_seconds", 1, ".2f"),
           ("graphs compiled", "graphs_compiled", 1, "d"),
           ("median step (s)", "step_seconds", 1, ".3f"),
           ("host per rank (s)", "host_seconds", 1, ".3f"),
           ("dispatch wall (s)", "dispatch_seconds", 1, ".3f"),
           ("wait (s)", "wait_seconds", 1, ".3f"),
           ("execute (s)", "execute_seconds", 1, ".3f"),
           ("host + execute (s)", "pod_estimate_seconds", 1, ".3f"),
           ("peak memory per rank (MB)", "peak_bytes", MB, ".1f")]
# (label, numerator variant, denominator variant, key, target) of the ratio table
RATIOS = [("ours scanned / ours unscanned, first step from process start",
           "xla_fsdp_scanned", "xla_fsdp", "startup_seconds", 0.25),
          ("ours scanned / ours unscanned, compile time",
           "xla_fsdp_scanned", "xla_fsdp", "compile_seconds", None),
          ("ours / FSDPv2, median step", "xla_fsdp", "fsdpv2", "step_seconds", 1.0),
          ("ours / FSDPv2, host + execute", "xla_fsdp", "fsdpv2", "pod_estimate_seconds",
           None),
          ("ours / FSDPv2, peak memory", "xla_fsdp", "fsdpv2", "peak_bytes", 1.0),
          ("ours scanned / FSDPv2 scan, median step",
           "xla_fsdp_scanned", "fsdpv2_scan", "step_seconds", 1.0),
          ("ours scanned / FSDPv2 scan, host + execute", "xla_fsdp_scanned", "fsdpv2_scan",
           "pod_estimate_seconds", None),
          ("ours scanned / FSDPv2 scan, peak memory",
           "xla_fsdp_scanned", "fsdpv2_scan", "peak_bytes", 1.0),
          ("FSDPv2 scan / FSDPv2, first step from process start",
           "fsdpv2_scan", "fsdpv2", "startup_seconds", None)]


def by_depth(results: List[dict]) -> Dict[int, Dict[str, dict]]:
    """{depth: {variant: result}} in the order measured."""
    out: Dict[int, Dict[str, dict]] = {}
    for r in results:
        out.setdefault(r["layers"], {})[r["impl"]] = r
    return out


def _cell(result: Optional[dict], key: str, scale: float, fmt: str) -> str:
    if result is None:
        return ""
    if "crashed" in result:
        return "-"
    value = result.get(key)
    if value is None or value != value:  # missing, or NaN (no inspection run)
        return "n/a"
    return f"{value / scale if scale != 1 else value:{fmt}}"


def loss_gap(group: Dict[str, dict], variant: str, reference: str = "xla_fsdp") -> str:
    """Largest difference of a variant's global loss from ours unscanned, over the steps."""
    a, b = group.get(variant, {}), group.get(reference, {})
    if "global_losses" not in a or "global_losses" not in b:
        return ""
    return f"{max(abs(x - y) for x, y in zip(a['global_losses'], b['global_losses'])):.1e}"


def ratio(results: Dict[str, dict], top: str, bottom: str, key: str) -> Optional[float]:
    a, b = results.get(top), results.get(bottom)
    if not a or not b or "crashed" in a or "crashed" in b:
        return None
    x, y = a.get(key), b.get(key)
    if x is None or y is None or x != x or y != y or not y:
        return None
    return x / y


def markdown(args, cfg: Config, results: List[dict], machine: str) -> str:
    depths = by_depth(with_estimates(results))
    variants = list(dict.fromkeys(r["impl"] for r in results))
    lines = [
        "# Depth sweep: ours (unscanned, scanned) and torch_xla's SPMD FSDPv2 (with and "
        "without scan_layers)", "",
        f"Machine: {machine}. N = {args.devices} virtual XLA:CPU devices.", "",
        f"Command: `python -m scripts.bench.depth --depths {' '.join(map(str, depths))} "
        f"--devices {args.devices} --repeats {args.repeats} --steps {cfg.steps} "
        f"--warmup {args.warmup} --dim {cfg.dim} --heads {cfg.heads} --vocab {cfg.vocab} "
        f"--seq {cfg.seq} --batch {cfg.batch}"
        f"{'' if list(args.variants) == list(VARIANTS) else ' --variants '}"
        f"{'' if list(args.variants) == list(VARIANTS) else ' '.join(args.variants)}"
        f"{'' if args.inspect else ' --no-inspect'}`", "",
        f"Model: the GPT of `scripts/bench/model.py` with width {cfg.dim}, {cfg.heads} heads, "
        f"vocabulary {cfg.vocab}; {cfg.batch} sequence(s) of {cfg.seq} tokens per rank "
        f"(FSDPv2: the same global batch, sharded along the batch); AdamW; float32. Every "
        "variant in a fresh process, order alternating between repetitions; medians over "
        f"repetitions of each run's median over its steps after the first {args.warmup}. "
        "Peak memory: XLA's compiled-program statistics of the step-2 graph (arguments + "
        "outputs - aliased + temporaries), from one extra inspection run per variant.", "",
        PHASES_TEXT, "", SPMD_MEMORY_TEXT, "",
        "`-`: the variant did not run (reason below the table); `n/a`: not measured. *loss vs "
        "xla_fsdp*: the largest difference of the global loss (mean over ranks; FSDPv2's "
        "own) from ours unscanned over the steps.", "",
    ]
    for depth, group in depths.items():
        lines += [f"## {depth} blocks", "",
                  "| | " + " | ".join(label for label, *_ in COLUMNS)
                  + " | loss vs xla_fsdp |",
                  "| --- |" + " --- |" * (len(COLUMNS) + 1)]
        for variant in variants:
            if variant in group:
                lines.append(f"| {variant} | " + " | ".join(
                    _cell(group[variant], key, scale, fmt)
                    for _, key, scale, fmt in COLUMNS) + f" | {loss_gap(group, variant)} |")
        lines.append("")
        lines += [f"{v}: {r['crashed']}" for v, r in group.items() if "crashed" in r]
        lines.append("")
    lines += ["## Ratios", "",
              "| ratio | " + " | ".join(f"{d} blocks" for d in depths) + " | target |",
              "| --- |" + " --- |" * (len(depths) + 1)]
    for label, top, bottom, key, target in RATIOS:
        values = [ratio(group, top, bottom, key) for group in depths.values()]
        if all(v is None for v in values):
            continue
        lines.append(f"| {label} | " + " | ".join("n/a" if v is None else f"{v:.3f}"
                                                   for v in values)
                     + f" | {'' if target is None else f'<= {target}'} |")
    return "\n".join(lines) + "\n"


def plot(results: List[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = by_depth(results)
    variants = list(dict.fromkeys(r["impl"] for r in results))
    panels = [("time to first step (s)", "startup_seconds", 1),
              ("compile time (s)", "compile_seconds", 1),
              ("median step (s)", "step_seconds", 1),
              ("peak memory per rank (MB)", "peak_bytes", MB)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (title, key, scale) in zip(axes, panels):
        for variant in variants:
            points = [(d, g[variant][key] / scale) for d, g in depths.items()
                      if variant in g and "crashed" not in g[variant]
                      and g[variant].get(key) == g[variant].get(key)]
            if points:
                ax.plot(*zip(*points), marker="o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(depths), [str(d) for d in depths])
        ax.set_xlabel("blocks")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.depth",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-inspect", dest="inspect", action="store_false",
                        help="skip the inspection runs (no memory)")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "depth"))
    for field in ("dim", "heads", "vocab", "seq", "batch", "steps"):
        parser.add_argument(f"--{field}", type=int, default=DEFAULTS[field])
    parser.add_argument("--report-from", metavar="JSON",
                        help="only re-render the table and chart from a saved depth_sweep.json")
    args = parser.parse_args()
    if args.report_from:
        with open(args.report_from) as f:
            saved = json.load(f)
        for key in ("devices", "repeats", "warmup", "variants", "inspect"):
            setattr(args, key, saved[key])
        args.out = os.path.dirname(os.path.abspath(args.report_from))
        write(args, Config(**saved["config"]), saved["results"])
        return
    cfg = Config(**{f: getattr(args, f) for f in DEFAULTS})
    if cfg.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    results = []
    os.makedirs(args.out, exist_ok=True)
    for depth in args.depths:
        depth_cfg = replace(cfg, layers=depth)
        for r in measure("defaults", args.devices, depth_cfg, args, args.variants):
            results.append(dict(r, layers=depth))
        with open(os.path.join(args.out, "depth_sweep.json"), "w") as f:  # after each depth
            json.dump({"config": asdict(cfg), "devices": args.devices,
                       "repeats": args.repeats, "warmup": args.warmup,
                       "variants": args.variants, "inspect": args.inspect,
                       "results": results}, f, indent=1)
    write(args, cfg, results)


def write(args, cfg: Config, results: List[dict]) -> None:
    text = markdown(args, cfg, results, machine())
    with open(os.path.join(args.out, "depth_sweep.md"), "w") as f:
        f.write(text)
    plot(results, os.path.join(args.out, "depth_sweep.png"))
    print(text)


if __name__ == "__main__":
    main()
