"""``python -m xla_fsdp.aot``: plan a training script for a TPU slice, or set the compiler up.

    python -m xla_fsdp.aot --topology v5e:2x4 train.py [script args]   # plan, print the report
    python -m xla_fsdp.aot install [--python PYTHON] [--venv DIR]      # the TPU compiler
    python -m xla_fsdp.aot topologies                                  # the known slices

Planning runs the script unchanged. Its call to ``xla_fsdp.launch(fn, args)`` (or to
torch_xla's ``torch_xla.launch`` / ``xmp.spawn``, which call ``fn`` the same way) compiles
``fn``'s training step for the slice instead of running it, prints the report and ends the
script there: what it would do with the results of a run cannot happen without one.
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys
from dataclasses import asdict
from typing import Any, Callable, List, Optional, Sequence

from ..launch.runner import launch_instead
from .plan import compile_for_tpu
from .report import TpuReport
from .topology import known_names, resolve
from .tpu_compiler import install


class _Planned(SystemExit):
    """Ends the script once its launch was planned."""


def _planning_launch(topology: str, max_graphs: int, json_path: Optional[str]
                     ) -> Callable[..., Any]:
    def launch_instead(fn: Callable[..., Any], args: Sequence[Any] = (), *_: Any,
                       **__: Any) -> Any:
        report = compile_for_tpu(fn, topology, args=tuple(args), max_graphs=max_graphs)
        print(f"\n{report}", flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(report_dict(report), f, indent=1)
        raise _Planned(0 if report.fits else 3)
    return launch_instead


def report_dict(report: TpuReport) -> dict:
    """The report as plain data (``--json``), its roofline included."""
    out = asdict(report)
    del out["hlo"]
    out["topology"] = {"name": report.topology.name, "cloud_name": report.topology.cloud_name,
                       "chips": report.topology.chips, "chip": asdict(report.topology.chip)}
    roof = report.roofline()
    out["roofline"] = asdict(roof) if roof is not None else None
    out["collective_summary"] = report.collective_summary()
    return out


def _install_launch(replacement: Callable[..., Any]) -> None:
    launch_instead(lambda fn, args: replacement(fn, args))
    try:
        import torch_xla
        import torch_xla.distributed.xla_multiprocessing as xmp
    except ImportError:
        return
    torch_xla.launch = replacement
    xmp.spawn = replacement


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["install"]:
        parser = argparse.ArgumentParser(prog="python -m xla_fsdp.aot install",
                                         description="Create the TPU compiler's environment")
        parser.add_argument("--python", help="a Python >= 3.12 to build it from")
        parser.add_argument("--venv", help="where (default ~/.cache/xla_fsdp/tpu-compiler)")
        parser.add_argument("--quiet", action="store_true")
        ns = parser.parse_args(argv[1:])
        print(f"TPU compiler ready: {install(ns.venv, ns.python, ns.quiet)}")
        return 0
    if argv[:1] == ["topologies"]:
        print("\n".join(known_names()))
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m xla_fsdp.aot",
        description="Compile a training script's step for a TPU slice with libtpu, here, "
                    "and report memory per chip, FLOPs and collectives",
        epilog="Also: `python -m xla_fsdp.aot install`, `python -m xla_fsdp.aot topologies`.")
    parser.add_argument("--topology", required=True,
                        help="e.g. v5e-8, v5e:2x4, v6e-256, v5p-8 (see `topologies`)")
    parser.add_argument("--json", help="also write the report to this file as JSON")
    parser.add_argument("--max-graphs", type=int, default=12,
                        help="different graphs to trace before giving up on a repeated step")
    parser.add_argument("script", help="the training script, run unchanged")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    try:
        resolve(ns.topology)
    except ValueError as exc:
        parser.error(str(exc))
    _install_launch(_planning_launch(ns.topology, ns.max_graphs, ns.json))
    sys.argv = [ns.script] + list(ns.script_args)
    try:
        runpy.run_path(ns.script, run_name="__main__")
    except _Planned as planned:
        return int(planned.code)
    print(f"xla_fsdp.aot: {ns.script} ended without calling launch(); nothing was planned",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
