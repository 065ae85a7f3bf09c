"""The markdown table and chart of ``scripts/bench.py``'s results."""
from __future__ import annotations

from typing import List

MB = 2**20  # "MB" in the tables is MiB, for measurements and minima alike


def _pairs(results: List[dict]):
    """[((setting, devices), {impl: result})] in the order measured."""
    grouped = {}
    for r in results:
        grouped.setdefault((r["setting"], r["devices"]), {})[r["impl"]] = r
    return list(grouped.items())


def _describe(settings) -> str:
    from bench import SETTINGS

    def one(key, value):
        if key == "controls":
            return f"xla_fsdp only: {', '.join(value)} (see `wrap` in `scripts/bench.py`)"
        return f"`{key}={value}`"

    return "; ".join(f"`{name}`: " + (", ".join(one(k, v) for k, v in SETTINGS[name].items())
                                      or "none") for name in settings)


def _changed_fields(cfg) -> str:
    from dataclasses import fields
    return "".join(f" --{f.name} {getattr(cfg, f.name)}" for f in fields(cfg)
                   if f.name != "steps" and getattr(cfg, f.name) != f.default)


def _ratio(ours: dict, theirs: dict, key: str) -> str:
    return f"{ours[key] / theirs[key]:.3f}" if key in ours and key in theirs else "n/a"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _bound(limit, ok) -> str:
    """A target's text; ``ok`` is None when it cannot be told (the competitor crashed)."""
    return f"<= {limit} ({'n/a' if ok is None else _verdict(ok)})"


def markdown_report(args, cfg, results: List[dict], machine: str) -> str:
    lines = [
        "# Training step: xla_fsdp vs torch_xla's FSDP",
        "",
        f"Machine: {machine}. Virtual XLA:CPU devices in one process (`xla_fsdp.launch`).",
        "",
        f"Command: `python scripts/bench.py --devices {' '.join(map(str, args.devices))} "
        f"--settings {' '.join(args.settings)} --repeats {args.repeats} --steps {cfg.steps} "
        f"--warmup {args.warmup}{_changed_fields(cfg)}`",
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
    for (setting, devices), pair in _pairs(results):
        ours, theirs = pair["xla_fsdp"], pair["torch_xla"]
        bound = ours["analytic"]
        if "crashed" in ours:
            lines += [f"## {setting}, N = {devices}", "", f"xla_fsdp: {ours['crashed']}", ""]
            continue
        # if torch_xla crashed its ratios are n/a; our own bounds (bytes, memory,
        # recompilation) still count
        lines += [f"## {setting}, N = {devices}", "",
                  f"{bound['params'] / 1e6:.1f} M parameters in {bound['units']} units, "
                  f"largest {bound['largest_unit'] / 1e6:.2f} M.", "",
                  "| | xla_fsdp | torch_xla | ours/theirs | target |",
                  "| --- | --- | --- | --- | --- |"]

        def row(label, a, b, fmt, target="", ratio=True):
            """``b`` is None when torch_xla crashed in this setting."""
            shown = "" if b is None or not ratio else f"{a / b:.3f}" if b else "nan"
            them = "crashed" if b is None else f"{b:{fmt}}"
            lines.append(f"| {label} | {a:{fmt}} | {them} | {shown} | {target} |")

        def theirs_of(key):
            return None if "crashed" in theirs else theirs[key]

        def both(label, key, fmt, limit=None):
            """A row whose target, if any, bounds the ratio ours/theirs."""
            a, b = ours[key], theirs_of(key)
            row(label, a, b, fmt, "" if limit is None else
                _bound(limit, None if b is None else a / b <= limit))

        both("median step time (s)", "step_seconds", ".3f", 0.85)
        both("time to first step (s)", "first_step_seconds", ".2f", 0.8)
        if "ready_seconds" in ours:  # runs saved before it was reported lack it
            both("... counted from the start of wrapping (s)", "ready_seconds", ".2f", 0.8)
        both("second step (s; compiles the graph with optimizer state)",
             "second_step_seconds", ".2f")
        both("wrapping the model (s)", "wrap_seconds", ".2f")
        a, b = ours["graphs_compiled"], theirs_of("graphs_compiled")
        row("graphs compiled", a, b, "d", _bound("theirs", None if b is None else a <= b))
        a = ours["recompiles_after_step_2"]
        row("recompilations after step 2", a, theirs_of("recompiles_after_step_2"), "d",
            f"0 ({_verdict(a == 0)})", ratio=False)
        for kind in sorted(set(ours["collectives"]) | set(theirs.get("collectives", {}))):
            count = {r["impl"]: r["collectives"].get(kind, {"count": 0})["count"]
                     for r in (ours, theirs) if "crashed" not in r}
            row(f"{kind} per step", count["xla_fsdp"], count.get("torch_xla"), "d")
        a, b = ours["collective_bytes"], theirs_of("collective_bytes")
        row("MB moved per step per rank", a / MB, None if b is None else b / MB, ".2f")
        minimum = bound["min_collective_bytes"]
        row(f"... over the analytic minimum ({minimum / MB:.2f} MB)", a / minimum,
            None if b is None else b / minimum, ".4f", _bound(1.02, a / minimum <= 1.02),
            ratio=False)
        a, b = ours["peak_bytes"], theirs_of("peak_bytes")
        row("peak memory per rank (MB, XLA)", a / MB, None if b is None else b / MB, ".1f",
            _bound("theirs", None if b is None else a <= b))
        minimum = bound["min_peak_bytes"]
        row(f"... over the analytic minimum ({minimum / MB:.1f} MB)", a / minimum,
            None if b is None else b / minimum, ".3f", _bound(1.25, a / minimum <= 1.25),
            ratio=False)
        lines.append("")
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
    width = 0.38
    for ax, (title, key, scale, bound) in zip(axes, panels):
        xs = range(len(pairs))
        for offset, impl in ((-width / 2, "xla_fsdp"), (width / 2, "torch_xla")):
            # a wrapper that crashed in a setting gets no bar there
            ax.bar([x + offset for x in xs],
                   [p[impl].get(key, float("nan")) / scale for _, p in pairs], width,
                   label=impl)
        if bound:
            for x, (_, p) in zip(xs, pairs):
                ax.hlines(p["xla_fsdp"]["analytic"][bound] / scale, x - width, x + width,
                          colors="black", linestyles="dashed",
                          label="analytic minimum" if x == 0 else None)
        ax.set_xticks(list(xs), [f"{s}\nN={d}" for (s, d), _ in pairs], fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
