"""``python -m xla_fsdp.aot``: plan a training script for a TPU slice, or set the compiler up.

    python -m xla_fsdp.aot --topology v5e:2x4 train.py [script args]   # plan, print the report
    python -m xla_fsdp.aot install [--python PYTHON] [--venv DIR]      # the TPU compiler
    python -m xla_fsdp.aot topologies                                  # the known slices
    python -m xla_fsdp.aot estimate --topology v6e-8 step.hlo          # any scheduled HLO

Planning runs the script unchanged. Its call to ``xla_fsdp.launch(fn, args)`` (or to
torch_xla's ``torch_xla.launch`` / ``xmp.spawn``, which call ``fn`` the same way) compiles
``fn``'s training step for the slice instead of running it, prints the report and ends the
script there: what it would do with the results of a run cannot happen without one.

Exit codes: 0 the step fits, 3 it does not, 4 the script reached no training step, 2 the
command line is wrong (a one-line message says how), 1 the script failed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Sequence

from ..launch.runner import LaunchError, launch_instead
from . import step_time
from .plan import STEPS, CompileFailed, NoTrainingStep, compile_for_tpu
from .report import TpuReport
from .topology import aliases, known_names, resolve
from .tpu_compiler import CompilerNotInstalled, compiler_python, install

FITS, USAGE, DOES_NOT_FIT, NO_TRAINING_STEP, SCRIPT_FAILED = 0, 2, 3, 4, 1


class _Planned(SystemExit):
    """Ends the script once its launch was planned."""


class _Refused(BaseException):
    """A one-line reason to stop, with the exit code it means (a BaseException, so that
    the script's own ``except Exception`` around its launch lets it through)."""

    def __init__(self, message: str, code: int = USAGE) -> None:
        super().__init__(message)
        self.code = code


def _planning_launch(ns: argparse.Namespace) -> Callable[..., Any]:
    def launch_instead(fn: Callable[..., Any], args: Sequence[Any] = (), *_: Any,
                       **__: Any) -> Any:
        try:
            report = compile_for_tpu(fn, ns.topology, args=tuple(args),
                                     max_graphs=ns.max_graphs, step=ns.step,
                                     alternatives=ns.alternatives,
                                     search_budget=ns.search_budget)
        except NoTrainingStep as exc:
            raise _Refused(str(exc), NO_TRAINING_STEP) from None
        except CompileFailed as exc:
            raise _Refused(str(exc), SCRIPT_FAILED) from None
        except LaunchError as exc:
            cause = exc.__cause__
            if isinstance(cause, SystemExit):    # the script chose to stop, and said why
                raise _Refused(f"{ns.script} stopped while being traced: {cause.code}",
                               SCRIPT_FAILED) from None
            raise
        print(f"\n{report}", flush=True)
        if ns.json:
            _write_json(ns.json, report_dict(report))
        raise _Planned(FITS if report.fits else DOES_NOT_FIT)
    return launch_instead


def report_dict(report: TpuReport) -> dict:
    """The report as plain data (``--json``), its estimate included."""
    out = {k: v for k, v in asdict(report).items() if k not in ("hlo", "optimized_hlo")}
    out["topology"] = {"name": report.topology.name, "cloud_name": report.topology.cloud_name,
                       "chips": report.topology.chips, "chip": asdict(report.topology.chip)}
    out["collective_summary"] = report.collective_summary()
    out["step_seconds"] = report.step_seconds
    out["mfu"], out["hfu"] = report.mfu, report.hfu
    return out


def _write_json(path: str, data: dict) -> None:
    """Written whole or not at all (the path was checked before tracing)."""
    partial = f"{path}.partial-{os.getpid()}"
    Path(partial).write_text(json.dumps(data, indent=1))
    os.replace(partial, path)


def _check_writable(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise _Refused(f"--json {path}: the directory {directory} does not exist")
    if os.path.isdir(path):
        raise _Refused(f"--json {path}: is a directory")
    if not os.access(directory, os.W_OK) or (os.path.exists(path)
                                              and not os.access(path, os.W_OK)):
        raise _Refused(f"--json {path}: not writable")


@contextlib.contextmanager
def _launches_planned(replacement: Callable[..., Any]) -> Iterator[None]:
    """Within the block, ``xla_fsdp.launch``, ``torch_xla.launch`` and ``xmp.spawn`` call
    ``replacement`` instead of launching."""
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp
    saved = torch_xla.launch, xmp.spawn
    launch_instead(lambda fn, args: replacement(fn, args))
    torch_xla.launch = xmp.spawn = replacement
    try:
        yield
    finally:
        launch_instead(None)
        torch_xla.launch, xmp.spawn = saved


def _topologies(argv: List[str]) -> int:
    lines = []
    for gen in ("v5e", "v6e", "v5p"):
        names = [a for a in aliases(gen) if a != gen]
        lines.append(f"{gen} (also: {', '.join(names)})" if names else gen)
        lines += ["  " + n for n in known_names(gen)]
    lines.append("v5p also takes any grid AxBxC of whole 4x4x4 cubes up to 6,144 chips "
                 "(e.g. v5p:4x8x12); v5p-N counts TensorCores, two per chip")
    print("\n".join(lines))
    return 0


def _install(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m xla_fsdp.aot install",
                                     description="Create the TPU compiler's environment")
    parser.add_argument("--python", help="a Python >= 3.12 to build it from")
    parser.add_argument("--venv", help="where (default ~/.cache/xla_fsdp/tpu-compiler)")
    parser.add_argument("--quiet", action="store_true")
    ns = parser.parse_args(argv)
    print(f"TPU compiler ready: {install(ns.venv, ns.python, ns.quiet)}")
    return 0


def _estimate(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m xla_fsdp.aot estimate",
        description="The step-time estimate of a program libtpu already compiled and "
                    "scheduled (its optimized HLO text, e.g. from --xla_dump_to), for any "
                    "framework")
    parser.add_argument("--topology", required=True)
    parser.add_argument("hlo", help="the optimized HLO module, as text")
    ns = parser.parse_args(argv)
    slice_ = _slice(ns.topology)
    if not os.path.isfile(ns.hlo):
        raise _Refused(f"{ns.hlo}: no such file")
    estimate = step_time.estimate(Path(ns.hlo).read_text(), slice_)
    print(json.dumps(asdict(estimate), indent=1))
    return 0


def _slice(name: str):
    try:
        return resolve(name)
    except ValueError as exc:
        raise _Refused(str(exc)) from None


def _plan(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m xla_fsdp.aot",
        description="Compile a training script's step for a TPU slice with libtpu, here, "
                    "and report memory per chip, collectives and an estimated step time",
        epilog="Also: `python -m xla_fsdp.aot install`, `... topologies`, `... estimate`.")
    parser.add_argument("--topology", required=True,
                        help="e.g. v5e-8, v5e:2x4, v6e-256, v5p-8 (see `topologies`)")
    parser.add_argument("--json", help="also write the report to this file as JSON")
    parser.add_argument("--step", choices=STEPS, default="train",
                        help="what to plan: the training step (default; a script that "
                             "reaches none is refused), or whatever the script repeats")
    parser.add_argument("--alternatives", type=int, default=2,
                        help="when the step does not fit, find this many configurations "
                             "that do (0: none); each is traced and compiled")
    parser.add_argument("--search-budget", type=int, default=8,
                        help="compiles the search for alternatives may spend")
    parser.add_argument("--max-graphs", type=int, default=12,
                        help="different graphs to trace before giving up on a repeated step")
    parser.add_argument("script", help="the training script, run unchanged")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    _slice(ns.topology)
    if not os.path.isfile(ns.script):
        raise _Refused(f"{ns.script}: no such file")
    if ns.json:
        _check_writable(ns.json)
    compiler_python()   # installed, before the script runs for minutes
    argv_before = sys.argv
    sys.argv = [ns.script] + list(ns.script_args)
    try:
        with _launches_planned(_planning_launch(ns)):
            runpy.run_path(ns.script, run_name="__main__")
    except _Planned as planned:
        return int(planned.code)
    finally:
        sys.argv = argv_before
    raise _Refused(f"{ns.script} ended without calling launch(); nothing was planned")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = {"install": _install, "topologies": _topologies,
               "estimate": _estimate}.get(argv[0] if argv else "")
    try:
        return command(argv[1:]) if command else _plan(argv)
    except (_Refused, CompilerNotInstalled) as exc:
        print(f"xla_fsdp.aot: {exc}", file=sys.stderr)
        return getattr(exc, "code", USAGE)


if __name__ == "__main__":
    sys.exit(main())
