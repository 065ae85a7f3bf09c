"""Measuring one setting at one device count: every run a fresh process (``launch`` for the
per-rank competitors, ``spmd_launch`` for FSDPv2), one extra inspection run per competitor
for the step graph, the order alternating between repetitions, crashes kept as results; then
the medians, the step graph's collectives and memory, and the analytic ZeRO-3 bounds."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
import time
from typing import Dict, List, Optional
from unittest import mock

from xla_fsdp.launch import LaunchError, launch

from .hlo import collectives_in_hlo, debug_file, step_graph
from .model import BASELINES, SPMD_IMPLS, SPMD_PROCESS, SPMD_SETTINGS, Config, unit_sizes
from .spmd import run_spmd, spmd_launch
from .train import run_rank


# -- one run --------------------------------------------------------------------------------
def _launch_impl(impl: str, setting: str, cfg: Config, devices: int,
                 marks_dir: Optional[str]) -> dict:
    """One fresh process; rank 0's result, with every rank's losses and host times."""
    launched_at = time.time()
    if impl in SPMD_PROCESS:
        run = spmd_launch(run_spmd, (impl, cfg, marks_dir, launched_at), devices)
        return dict(run, global_losses=run["losses"], per_rank=[_host(run)])
    ranks = launch(run_rank, (impl, setting, cfg, marks_dir, launched_at), num_devices=devices)
    # ranks see different batches of the same size: the global loss is their mean
    losses = [statistics.fmean(step) for step in zip(*(r["losses"] for r in ranks.values()))]
    return dict(ranks[0], global_losses=losses, per_rank=[_host(r) for r in ranks.values()])


HOST_KEYS = ("host", "host_thread", "host_backward")


def _host(run: dict) -> dict:
    return {key: run[key] for key in HOST_KEYS}


def one_run(impl: str, setting: str, cfg: Config, devices: int, inspect: bool) -> dict:
    if not inspect:
        return _launch_impl(impl, setting, cfg, devices, None)
    marks_dir = tempfile.mkdtemp(prefix="xla_fsdp_bench_")
    os.makedirs(os.path.join(marks_dir, "dump"))
    env = {"XLA_FLAGS": f"--xla_dump_to={marks_dir}/dump --xla_dump_hlo_as_text",
           "PT_XLA_DEBUG_LEVEL": "2", "PT_XLA_DEBUG_FILE": debug_file(marks_dir)}
    try:
        with mock.patch.dict(os.environ, env):  # the device process inherits them
            run = _launch_impl(impl, setting, cfg, devices, marks_dir)
        suffix = ".cpu_after_optimizations.txt" if impl in SPMD_IMPLS else None
        return dict(run, graph=step_graph(marks_dir, *([suffix] if suffix else [])))
    finally:
        shutil.rmtree(marks_dir, ignore_errors=True)


# -- summaries ------------------------------------------------------------------------------
def phases(runs: List[dict], warmup: int) -> dict:
    """Medians over runs of each run's median over its steps after ``warmup``; the host time
    is a rank's own (the median over ranks)."""
    def med(key):
        return statistics.median(statistics.median(r[key][warmup:]) for r in runs)

    def per_rank(key):
        return statistics.median(
            statistics.median(statistics.median(rank[key][warmup:]) for rank in r["per_rank"])
            for r in runs)
    return {
        "step_seconds": med("times"), "dispatch_seconds": med("dispatch"),
        "wait_seconds": med("wait"), "execute_seconds": med("execute"),
        "host_seconds": per_rank("host"), "host_thread_seconds": per_rank("host_thread"),
        "host_backward_seconds": per_rank("host_backward"),
        "startup_seconds": statistics.median(r["startup_seconds"] for r in runs),
        "compile_seconds": statistics.median(r["compile_seconds"] for r in runs),
        "compile_seconds_step_1": statistics.median(r["compile_seconds_step_1"] for r in runs),
    }


def summarize(impl: str, setting: str, runs: List[dict], inspection: dict, cfg: Config,
              devices: int, warmup: int) -> dict:
    steady = [statistics.median(r["times"][warmup:]) for r in runs]
    counts = [r["compile_counts"] for r in runs]
    coll = collectives_in_hlo(inspection["graph"]["hlo"], devices)
    return dict(phases(runs, warmup), **{
        "impl": impl, "setting": setting, "devices": devices,
        "step_seconds": statistics.median(steady), "step_seconds_runs": steady,
        "first_step_seconds": statistics.median(r["times"][0] for r in runs),
        "second_step_seconds": statistics.median(r["times"][1] for r in runs),
        "wrap_seconds": statistics.median(r["wrap_seconds"] for r in runs),
        # what a user waits for: building and wrapping the model, then the first step
        "ready_seconds": statistics.median(r["wrap_seconds"] + r["times"][0] for r in runs),
        "graphs_compiled": max(c[-1] for c in counts),
        "graphs_in_wrap": max(r["compiles_at_start"] for r in runs),
        "recompiles_after_step_2": max(c[-1] - c[1] for c in counts),
        "collectives": coll,
        "collective_count": sum(v["count"] for v in coll.values()),
        "collective_bytes": sum(v["bytes"] for v in coll.values()),
        "peak_bytes": inspection["graph"]["peak_bytes"],
        "memory": inspection["graph"]["memory"],
        "graphs_in_step_2": inspection["graph"]["graphs_in_step_2"],
        "losses": runs[0]["losses"], "global_losses": runs[0]["global_losses"],
    })


def analytic(cfg: Config, devices: int) -> dict:
    """ZeRO-3 lower bounds per rank, float32 everywhere.

    Bytes: every unit's parameters are all-gathered for forward, again for backward unless
    the unit keeps them (the root does: ``disable_reshard_on_root``), and their gradients are
    reduce-scattered once; each collective moves (N-1)/N of the unit. Memory: the shards of
    parameters, gradients and AdamW's two moments, plus the full parameters and gradients of
    the largest unit."""
    sizes = unit_sizes(cfg)
    share = (devices - 1) / devices
    *blocks, root = sizes
    moved = 4 * share * (3 * sum(blocks) + 2 * root)
    total = sum(sizes)
    memory = 4 * 4 * total / devices + 2 * 4 * max(sizes)
    return {"params": total, "units": len(sizes), "largest_unit": max(sizes),
            "min_collective_bytes": moved, "min_peak_bytes": memory}


def crash_reason(error: Exception) -> str:
    """The first line of a LaunchError; a variant whose code cannot be imported (e.g. an API
    not written yet) is "unavailable", not crashed."""
    text = str(error)
    first = text.splitlines()[0] if text else type(error).__name__
    if "ImportError" in text or "ModuleNotFoundError" in text:
        missing = re.search(r"(?:ImportError|ModuleNotFoundError): (.*)", text)
        return "unavailable: " + (missing.group(1) if missing else first)
    return first


# -- a setting ------------------------------------------------------------------------------
def impls_for(setting: str, wanted) -> List[str]:
    """The competitors of a setting: FSDPv2 (and its unwrapped baseline) only where its
    options are the same."""
    return [i for i in wanted if i not in SPMD_PROCESS or setting in SPMD_SETTINGS]


def measure(setting: str, devices: int, cfg: Config, args: argparse.Namespace,
            impls=None) -> List[dict]:
    impls = list(impls or impls_for(setting, args.impls))
    runs: Dict[str, List[dict]] = {impl: [] for impl in impls}
    inspections, crashes = {}, {}
    for impl in impls:
        if not args.inspect or impl in BASELINES:  # a baseline is only timed
            continue
        print(f"{setting} N={devices} {impl}: inspection run", flush=True)
        try:
            inspections[impl] = one_run(impl, setting, cfg, devices, inspect=True)
        except LaunchError as error:  # a wrapper that dies in a setting is a result too
            crashes[impl] = crash_reason(error)
            print(f"{setting} N={devices} {impl}: {crashes[impl]}", flush=True)
    running = [impl for impl in impls if impl not in crashes]
    for rep in range(args.repeats):
        for impl in (running if rep % 2 == 0 else running[::-1]):
            if impl in crashes:
                continue
            try:
                run = one_run(impl, setting, cfg, devices, inspect=False)
            except LaunchError as error:
                crashes[impl] = crash_reason(error)
                print(f"{setting} N={devices} {impl}: {crashes[impl]}", flush=True)
                continue
            print(f"{setting} N={devices} {impl} rep {rep + 1}: step "
                  f"{statistics.median(run['times'][args.warmup:]):.3f} s, first "
                  f"{run['times'][0]:.1f} s, startup {run['startup_seconds']:.1f} s, "
                  f"loss {run['global_losses'][-1]:.4f}", flush=True)
            runs[impl].append(run)
    bound = analytic(cfg, devices)
    crashed = [{"impl": impl, "setting": setting, "devices": devices, "crashed": why,
                "analytic": bound} for impl, why in crashes.items()]
    no_graph = {"graph": {"hlo": "", "peak_bytes": float("nan"), "memory": [],
                          "graphs_in_step_2": 0}}
    return crashed + [dict(summarize(impl, setting, runs[impl], inspections.get(impl, no_graph),
                                     cfg, devices, args.warmup), analytic=bound)
                      for impl in impls if impl not in crashes]
