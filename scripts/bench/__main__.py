"""Training-step benchmark: xla_fsdp against torch_xla's own FSDP, side by side.

    python -m scripts.bench [--devices 4 8] [--repeats 3] [--steps 8]

Run from the repository root. Both wrap the same GPT (each block a unit, the rest in the
root), start from the same weights, see the same batches and run AdamW, on N virtual XLA:CPU
devices under ``xla_fsdp.launch``. In the ``defaults`` setting torch_xla's SPMD FSDPv2 is a
third competitor: one process holding the N devices, the same global batch sharded along the
batch dimension (``scripts/bench/spmd.py``). torch_xla's FSDP runs with
``pin_layout_in_collective_ops=False`` because its pinned all-gather cannot run on virtual
devices; xla_fsdp runs with its defaults. Every run is a fresh process (so compilation is
measured), and the order alternates between repetitions. Per implementation and device
count, one extra *inspection* run dumps the step graph's HLO (collectives, bytes they move)
and XLA's compiled-program memory statistics; its timings are not used.

Writes ``benchmarks/results/train_step.{json,md,png}`` (``--out`` for another directory).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from typing import List

from .measure import measure
from .model import BASELINES, COMPARISON, IMPLS, SETTINGS, SPMD_IMPLS, Config
from .report import RESULTS_DIR, machine, markdown_report, plot


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS),
                        default=COMPARISON, help="wrapper options, the same for both")
    parser.add_argument("--impls", nargs="+",
                        default=list(IMPLS) + ["fsdpv2"] + list(BASELINES),
                        choices=list(IMPLS) + list(SPMD_IMPLS) + list(BASELINES),
                        help="competitors (FSDPv2 variants only in the defaults setting) and "
                             "the unwrapped baselines their host time is split against")
    parser.add_argument("--no-inspect", dest="inspect", action="store_false",
                        help="skip the inspection runs (no HLO, no memory)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3,
                        help="steps left out of the step-time median (compilation happens in "
                             "steps 1 and 2)")
    parser.add_argument("--out", default=RESULTS_DIR)
    for field, default in asdict(Config()).items():
        parser.add_argument(f"--{field}", type=type(default), default=default)
    parser.add_argument("--report-from", metavar="JSON",
                        help="only re-render the table and chart from a saved train_step.json")
    args = parser.parse_args()
    if args.report_from:
        with open(args.report_from) as f:
            saved = json.load(f)
        results = saved["results"]
        args.repeats, args.warmup = saved["repeats"], saved["warmup"]
        args.impls = saved.get("impls", list(IMPLS))
        args.inspect = saved.get("inspect", True)
        args.devices = list(dict.fromkeys(r["devices"] for r in results))
        args.settings = list(dict.fromkeys(r["setting"] for r in results))
        args.out = os.path.dirname(os.path.abspath(args.report_from))
        write_report(args, Config(**saved["config"]), results)
        return
    cfg = Config(**{f: getattr(args, f) for f in asdict(Config())})
    if cfg.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    results = []
    for setting in args.settings:
        for devices in args.devices:
            results += measure(setting, devices, cfg, args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train_step.json"), "w") as f:
        json.dump({"config": asdict(cfg), "repeats": args.repeats, "warmup": args.warmup,
                   "impls": args.impls, "inspect": args.inspect, "results": results},
                  f, indent=1)
    write_report(args, cfg, results)


def write_report(args, cfg: Config, results: List[dict]) -> None:
    text = markdown_report(args, cfg, results, machine())
    with open(os.path.join(args.out, "train_step.md"), "w") as f:
        f.write(text)
    plot(results, os.path.join(args.out, "train_step.png"))
    print(text)


if __name__ == "__main__":
    main()
