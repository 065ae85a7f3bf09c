"""The markdown table and chart of the benchmark's results (``python -m scripts.bench``),
the texts its reports share with the depth sweep's, and the machine line."""
from __future__ import annotations

import os
import platform
from dataclasses import fields
from typing import List

import torch

from .model import BASELINE_OF, BASELINES, SETTINGS

# where the reports go unless --out says otherwise
RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks", "results")
MB = 2**20  # "MB" in the tables is MiB, for measurements and minima alike
SPMD = "fsdpv2"  # torch_xla's SPMD FSDPv2: an extra column where it ran
DEFAULT_IMPLS = ["xla_fsdp", "torch_xla", SPMD, *BASELINES]

# What the phase rows mean, here and on a TPU pod (shared with the depth sweep's report).
PHASES_TEXT = (
    "Phases of a step after warm-up: *host* is the CPU time a rank spends from the step's "
    "start until `torch_xla.sync()` returns (tracing forward, backward and AdamW, hashing "
    "the graph, launching it): its own thread's, plus that of the autograd engine's thread "
    "for its device, which traces backward (on XLA, backward runs there, not on the thread "
    "that calls `loss.backward()`; runs before this was counted measured the first part "
    "only); *dispatch wall* is the wall time of that span, "
    "which on virtual devices also holds the other ranks' tracing, since the N ranks are "
    "threads of one process sharing one GIL and the launcher's sync waits for all of them; "
    "*wait* is the wall time from there until the loss is on the host; *execute* is "
    "torch_xla's own execute-time metric per execution (`ExecuteTime`, for FSDPv2 "
    "`ExecuteReplicatedTime`), the devices running the step. For ours the two agree; "
    "FSDPv2's `torch_xla.sync()` sometimes returns only after its step has executed, so its "
    "wait can be near zero and its execution inside the dispatch wall: *execute* is the "
    "device time to read. "
    "FSDPv2 traces once for all N devices in its one process, so its dispatch wall is its "
    "host time. On a TPU pod every host traces its own ranks in parallel: a rank's step "
    "there costs about *host* + *device execution* (the step blocks on the loss), and the "
    "serialized N x host seen here disappears (*host + execute* estimates such a "
    "step); FSDPv2's process on each host traces the "
    "whole (global) step once, which is its *host*. Device times here are N virtual devices "
    "sharing 2 CPU cores and say little about a TPU. Compile time is torch_xla's "
    "`CompileTime` metric over the run (every graph, once per process: the virtual devices "
    "share one compilation cache, and FSDPv2 compiles one SPMD program and partitions it); "
    "time to first step counts from the parent starting the fresh process (Python, torch "
    "and torch_xla imports included) until the first step's loss is on the host.")
SPMD_MEMORY_TEXT = (
    "FSDPv2's memory is XLA's compiled-program statistics of its SPMD program, which are "
    "those of the partitioned per-device program (its graph inputs are the parameter and "
    "optimizer-state shards of one device, not N of them): they are used as they are, as "
    "per-rank memory, not divided by N. Its collectives are read from that per-device "
    "program after XLA's optimizations (before them the SPMD program has none); a "
    "collective inside a while loop (scan) is counted once.")


def publish(lines: List[str], path: str) -> None:
    """Writes a report's markdown ``lines`` to ``path`` (its folder made) and prints them."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _pairs(results: List[dict]):
    """[((setting, devices), {impl: result})] in the order measured."""
    grouped = {}
    for r in results:
        grouped.setdefault((r["setting"], r["devices"]), {})[r["impl"]] = r
    return list(grouped.items())


def machine() -> str:
    """The machine and versions, for a report's first line."""
    import torch_xla
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"torch_xla {torch_xla.__version__}")


def _describe(settings) -> str:
    def one(key, value):
        if key == "controls":
            return (f"xla_fsdp only: {', '.join(value)} "
                    f"(see `wrap` in `scripts/bench/model.py`)")
        return f"`{key}={value}`"

    return "; ".join(f"`{name}`: " + (", ".join(one(k, v) for k, v in SETTINGS[name].items())
                                      or "none") for name in settings)


def _changed_fields(cfg) -> str:
    return "".join(f" --{f.name} {getattr(cfg, f.name)}" for f in fields(cfg)
                   if f.name != "steps" and getattr(cfg, f.name) != f.default)


def with_estimates(results: List[dict]) -> List[dict]:
    """Adds ``pod_estimate_seconds``, host + execute: one rank's tracing, then the devices,
    as a step costs where ranks trace in parallel. The execute metric, not the wait, is the
    device time: FSDPv2's sync sometimes returns only once the step has executed."""
    return [dict(r, pod_estimate_seconds=r["host_seconds"] + r["execute_seconds"])
            if "host_seconds" in r and "execute_seconds" in r else r for r in results]


def _ratio(ours: dict, theirs: dict, key: str) -> str:
    return f"{ours[key] / theirs[key]:.3f}" if key in ours and key in theirs else "n/a"


def spmd_summary(results: List[dict]) -> List[str]:
    """Ratios ours/FSDPv2 of the groups where FSDPv2 ran (none: no lines)."""
    rows = []
    for (setting, devices), group in _pairs(results):
        ours, spmd = group.get("xla_fsdp", {}), group.get(SPMD)
        if spmd is None:
            continue
        if "crashed" in ours or "crashed" in spmd:
            who = "xla_fsdp" if "crashed" in ours else "FSDPv2"
            rows.append(f"| {setting} | {devices} | {who}: "
                        f"{(ours if who == 'xla_fsdp' else spmd)['crashed']} | | | | | | |")
            continue
        rows.append(f"| {setting} | {devices} | " + " | ".join(
            _ratio(ours, spmd, k) for k in ("step_seconds", "startup_seconds",
                                            "compile_seconds", "host_seconds",
                                            "execute_seconds", "pod_estimate_seconds",
                                            "peak_bytes")) + " |")
    if not rows:
        return []
    return ["## Summary against torch_xla's SPMD FSDPv2 (ratios ours/FSDPv2)", "",
            "| options | N | step time | time to first step | compile time | host per rank "
            "| device execution | host + execute | peak memory per rank |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + rows + [""]


SPLIT_TEXT = (
    "Host split: a competitor's host time per rank is the unwrapped model's own tracing "
    "(the same model, batches, AdamW and loop with no wrapper: `unwrapped` per rank under "
    "the launcher for the per-rank wrappers, `spmd_unwrapped` in the SPMD process for "
    "FSDPv2) plus the wrapper's overhead, the difference. Both are medians of the same "
    "launch's runs, so an overhead smaller than the machine's noise (a few ms here) is "
    "not told apart from zero.")


def host_split(results: List[dict]) -> List[str]:
    """The host-time split of each group where a competitor's baseline ran (none: no
    lines), with the issue's targets: overhead <= 0.50x torch_xla's, host + execute <=
    1.00x FSDPv2's."""
    lines = []
    for (setting, devices), group in _pairs(results):
        rows = []

        def overhead(impl):
            r, base = group.get(impl), group.get(BASELINE_OF.get(impl, ""))
            if not r or not base or "crashed" in r or "crashed" in base:
                return None
            return r["host_seconds"] - base["host_seconds"]

        theirs, spmd = overhead("torch_xla"), group.get(SPMD)
        for impl, r in group.items():
            if impl in BASELINES or "crashed" in r or overhead(impl) is None:
                continue
            base = group[BASELINE_OF[impl]]
            mine = overhead(impl)
            vs_theirs = (f"{mine / theirs:.2f}" if theirs and impl != "torch_xla" else "")
            vs_spmd = ""
            if spmd and "crashed" not in spmd and impl != SPMD:
                ratio = r["pod_estimate_seconds"] / spmd["pod_estimate_seconds"]
                vs_spmd = f"{ratio:.3f}"
            split = (f" ({r['host_thread_seconds'] * 1e3:.1f} + "
                     f"{r['host_backward_seconds'] * 1e3:.1f})"
                     if "host_thread_seconds" in r else "")
            rows.append(f"| {impl} | {r['host_seconds'] * 1e3:.1f}{split} | "
                        f"{base['host_seconds'] * 1e3:.1f} | {mine * 1e3:.1f} | {vs_theirs} | "
                        f"{r['execute_seconds'] * 1e3:.0f} | "
                        f"{r['pod_estimate_seconds'] * 1e3:.0f} | {vs_spmd} |")
        if rows:
            lines += [f"## Host split, {setting}, N = {devices}", "",
                      "| competitor | host per rank (ms; rank thread + backward thread) | unwrapped model (ms) | wrapper "
                      "overhead (ms) | overhead / torch_xla's (target <= 0.50) | device "
                      "execution (ms) | host + execute (ms) | / FSDPv2's (target <= 1.00) |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- |"] + rows + [""]
    return [SPLIT_TEXT, ""] + lines if lines else []


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _bound(limit, ok) -> str:
    """A target's text; ``ok`` is None when it cannot be told (the competitor crashed)."""
    return f"<= {limit} ({'n/a' if ok is None else _verdict(ok)})"


def markdown_report(args, cfg, results: List[dict], machine: str) -> str:
    results = with_estimates(results)
    spmd_ran = any(r["impl"] == SPMD for r in results)
    impls = getattr(args, "impls", None)
    lines = [
        "# Training step: xla_fsdp vs torch_xla's FSDP" + (" and SPMD FSDPv2" if spmd_ran else ""),
        "",
        f"Machine: {machine}. Virtual XLA:CPU devices in one process (`xla_fsdp.launch`).",
        "",
        f"Command: `python -m scripts.bench --devices {' '.join(map(str, args.devices))} "
        f"--settings {' '.join(args.settings)} --repeats {args.repeats} --steps {cfg.steps} "
        f"--warmup {args.warmup}{_changed_fields(cfg)}"
        f"{' --impls ' + ' '.join(impls) if impls and impls != DEFAULT_IMPLS else ''}"
        f"{'' if getattr(args, 'inspect', True) else ' --no-inspect'}`",
        "",
        f"Model: GPT, {cfg.layers} blocks of width {cfg.dim}, {cfg.heads} heads, vocabulary "
        f"{cfg.vocab}, untied head; {cfg.batch} sequence(s) of {cfg.seq} tokens per rank; "
        f"AdamW; float32. Each block is a unit (`transformer_auto_wrap_policy`), the "
        f"embeddings, final norm and head are the root. Both wrappers get the same options "
        f"({_describe(args.settings)}); torch_xla also gets "
        f"`pin_layout_in_collective_ops=False` (its pinned all-gather cannot run on virtual "
        f"devices).",
        "",
        "Times are medians over the repetitions (each a fresh process, order alternating); a "
        f"run's step time is the median of its steps after the first {args.warmup}. The "
        "first step includes tracing and compiling; counted from the start of wrapping, it "
        "also includes building the model on the CPU, wrapping it and creating the optimizer "
        "(what a user waits for before training starts). Collectives and memory come from one "
        "extra inspection run per implementation: the HLO of the graph compiled in step 2 "
        "(the one every later step reuses) and XLA's compiled-program memory statistics for "
        "it (`PT_XLA_DEBUG_LEVEL=2`: arguments + outputs - aliased + temporaries, per rank). "
        "Bytes moved count what each rank sends in a ring: (N-1)/N of an all-gather's "
        "result or of a reduce-scatter's input. MB means 2^20 bytes throughout.",
        "",
    ]
    if spmd_ran:
        lines += ["FSDPv2 (torch_xla's `SpmdFullyShardedDataParallel`, "
                  "`scripts/bench/spmd.py`): one process holding the N devices, mesh "
                  "`(N, 1)` over `('fsdp', 'model')`, every block wrapped and then the root, "
                  "the same global batch sharded along the batch; same weights and AdamW. "
                  "Its loss is the global mean, compared with the mean of our ranks' losses.",
                  "", SPMD_MEMORY_TEXT, ""]
    if any("host_seconds" in r for r in results):
        lines += [PHASES_TEXT, ""]
    lines += ["## Summary (ratios ours/theirs)", "",
              "| options | N | step time | first step | wrap + first step | graphs "
              "| MB moved / minimum | peak memory | peak / minimum |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (setting, devices), pair in _pairs(results):
        ours, theirs = pair["xla_fsdp"], pair["torch_xla"]
        if "crashed" in ours:
            lines.append(f"| {setting} | {devices} | xla_fsdp crashed | | | | | | |")
            continue
        graphs = "crashed" if "crashed" in theirs else theirs["graphs_compiled"]
        lines.append(
            f"| {setting} | {devices} | {_ratio(ours, theirs, 'step_seconds')} | "
            f"{_ratio(ours, theirs, 'first_step_seconds')} | "
            f"{_ratio(ours, theirs, 'ready_seconds')} | "
            f"{ours['graphs_compiled']} vs {graphs} | "
            f"{ours['collective_bytes'] / ours['analytic']['min_collective_bytes']:.4f} | "
            f"{_ratio(ours, theirs, 'peak_bytes')} | "
            f"{ours['peak_bytes'] / ours['analytic']['min_peak_bytes']:.3f} |")
    lines.append("")
    lines += spmd_summary(results)
    lines += host_split(results)
    for (setting, devices), pair in _pairs(results):
        ours, theirs = pair["xla_fsdp"], pair["torch_xla"]
        spmd = pair.get(SPMD)
        spmd_ok = spmd is not None and "crashed" not in spmd
        bound = ours["analytic"]
        if "crashed" in ours:
            lines += [f"## {setting}, N = {devices}", "", f"xla_fsdp: {ours['crashed']}", ""]
            continue
        # if torch_xla crashed its ratios are n/a; our own bounds (bytes, memory,
        # recompilation) still count
        lines += [f"## {setting}, N = {devices}", "",
                  f"{bound['params'] / 1e6:.1f} M parameters in {bound['units']} units, "
                  f"largest {bound['largest_unit'] / 1e6:.2f} M.", "",
                  "| | xla_fsdp | torch_xla | ours/theirs |"
                  + (" FSDPv2 | ours/FSDPv2 |" if spmd else "") + " target |",
                  "| --- | --- | --- | --- | --- |" + (" --- | --- |" if spmd else "")]

        def cells(a, b, fmt, ratio, missing="crashed"):
            shown = "" if b is None or not ratio else f"{a / b:.3f}" if b else "nan"
            return f"{missing if b is None else f'{b:{fmt}}'} | {shown}"

        def row(label, a, b, fmt, target="", ratio=True, c=None):
            """``b`` is None when torch_xla crashed in this setting, ``c`` FSDPv2's value."""
            extra = ""
            if spmd:
                extra = " " + cells(a, c, fmt, ratio, spmd.get("crashed", "n/a")
                                    if c is None else "") + " |"
            lines.append(f"| {label} | {a:{fmt}} | {cells(a, b, fmt, ratio)} |{extra}"
                         f" {target} |")

        def theirs_of(key):
            return None if "crashed" in theirs else theirs[key]

        def spmd_of(key):
            return spmd.get(key) if spmd_ok else None

        def both(label, key, fmt, limit=None):
            """A row whose target, if any, bounds the ratio ours/theirs."""
            a, b = ours[key], theirs_of(key)
            row(label, a, b, fmt, "" if limit is None else
                _bound(limit, None if b is None else a / b <= limit), c=spmd_of(key))

        both("median step time (s)", "step_seconds", ".3f", 0.85)
        both("time to first step (s)", "first_step_seconds", ".2f", 0.8)
        if "ready_seconds" in ours:  # runs saved before it was reported lack it
            both("... counted from the start of wrapping (s)", "ready_seconds", ".2f", 0.8)
        both("second step (s; compiles the graph with optimizer state)",
             "second_step_seconds", ".2f")
        both("wrapping the model (s)", "wrap_seconds", ".2f")
        if "host_seconds" in ours:  # runs saved before the phases were measured lack them
            both("time to first step from process start (s)", "startup_seconds", ".2f")
            both("compile time, all graphs (s, CompileTime)", "compile_seconds", ".2f")
            both("host time per rank per step (s, CPU)", "host_seconds", ".3f")
            both("dispatch wall per step (s)", "dispatch_seconds", ".3f")
            both("waiting for the device per step (s)", "wait_seconds", ".3f")
            both("device execution per graph (s, execute metric)", "execute_seconds", ".3f")
            both("host + execute: a step without serialized tracing (s)",
                 "pod_estimate_seconds", ".3f")

        def scaled(value, by):
            return None if value is None else value / by

        a, b = ours["graphs_compiled"], theirs_of("graphs_compiled")
        row("graphs compiled", a, b, "d", _bound("theirs", None if b is None else a <= b),
            c=spmd_of("graphs_compiled"))
        a = ours["recompiles_after_step_2"]
        row("recompilations after step 2", a, theirs_of("recompiles_after_step_2"), "d",
            f"0 ({_verdict(a == 0)})", ratio=False, c=spmd_of("recompiles_after_step_2"))
        others = [r for r in (theirs, spmd) if r and "crashed" not in r]
        for kind in sorted(set(ours["collectives"]).union(*(r["collectives"] for r in others))):
            count = {r["impl"]: r["collectives"].get(kind, {"count": 0})["count"]
                     for r in [ours] + others}
            row(f"{kind} per step", count["xla_fsdp"], count.get("torch_xla"), "d",
                c=count.get(SPMD))
        a, b = ours["collective_bytes"], theirs_of("collective_bytes")
        c = spmd_of("collective_bytes")
        row("MB moved per step per rank", a / MB, scaled(b, MB), ".2f", c=scaled(c, MB))
        minimum = bound["min_collective_bytes"]
        row(f"... over the analytic minimum ({minimum / MB:.2f} MB)", a / minimum,
            scaled(b, minimum), ".4f", _bound(1.02, a / minimum <= 1.02),
            ratio=False, c=scaled(c, minimum))
        a, b, c = ours["peak_bytes"], theirs_of("peak_bytes"), spmd_of("peak_bytes")
        row("peak memory per rank (MB, XLA)", a / MB, scaled(b, MB), ".1f",
            _bound("theirs", None if b is None else a <= b), c=scaled(c, MB))
        minimum = bound["min_peak_bytes"]
        row(f"... over the analytic minimum ({minimum / MB:.1f} MB)", a / minimum,
            scaled(b, minimum), ".3f", _bound(1.25, a / minimum <= 1.25),
            ratio=False, c=scaled(c, minimum))
        lines.append("")
        if spmd_ok and "global_losses" in ours:
            diff = max(abs(x - y) for x, y in zip(ours["global_losses"], spmd["global_losses"]))
            lines += [f"Largest difference between our global loss (mean over ranks) and "
                      f"FSDPv2's: {diff:.2e}. Per-run step times (s), FSDPv2: "
                      f"{', '.join(f'{t:.3f}' for t in spmd['step_seconds_runs'])}.", ""]
        elif spmd and not spmd_ok:
            lines += [f"FSDPv2: {spmd['crashed']}", ""]
        if "crashed" in theirs:
            lines += [f"torch_xla: {theirs['crashed']}", ""]
            continue
        diff = max(abs(x - y) for x, y in zip(ours["losses"], theirs["losses"]))
        lines += [f"Largest loss difference between the two over {len(ours['losses'])} "
                  f"steps: {diff:.2e}. Per-run step times (s): xla_fsdp "
                  f"{', '.join(f'{t:.3f}' for t in ours['step_seconds_runs'])}; torch_xla "
                  f"{', '.join(f'{t:.3f}' for t in theirs['step_seconds_runs'])}.", ""]
    return "\n".join(lines) + "\n"


def plot(results: List[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = _pairs(results)
    panels = [("median step time (s)", "step_seconds", 1, None),
              ("time to first step (s)", "first_step_seconds", 1, None),
              ("MB moved per step per rank", "collective_bytes", MB, "min_collective_bytes"),
              ("peak memory per rank (MB)", "peak_bytes", MB, "min_peak_bytes")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    impls = list(dict.fromkeys(r["impl"] for r in results))
    width = 0.8 / len(impls)
    for ax, (title, key, scale, bound) in zip(axes, panels):
        xs = range(len(pairs))
        for i, impl in enumerate(impls):
            # a wrapper that crashed in a setting, or did not run there, gets no bar
            offset = (i - (len(impls) - 1) / 2) * width
            ax.bar([x + offset for x in xs],
                   [p.get(impl, {}).get(key, float("nan")) / scale for _, p in pairs],
                   width, label=impl)
        if bound:
            for x, (_, p) in zip(xs, pairs):
                ax.hlines(p["xla_fsdp"]["analytic"][bound] / scale, x - 0.4, x + 0.4,
                          colors="black", linestyles="dashed",
                          label="analytic minimum" if x == 0 else None)
        ax.set_xticks(list(xs), [f"{s}\nN={d}" for (s, d), _ in pairs], fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
