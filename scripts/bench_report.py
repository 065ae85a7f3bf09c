"""The markdown table and chart of ``scripts/bench.py``'s results."""
from __future__ import annotations

from typing import List

MB = 2**20


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
        "result or of a reduce-scatter's input.",
        "",
    ]
    lines += ["## Summary (ratios ours/theirs)", "",
              "| options | N | step time | first step | wrap + first step | graphs "
              "| MB moved / minimum | peak memory | peak / minimum |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (setting, devices), pair in _pairs(results):
        ours, theirs = pair["xla_fsdp"], pair["torch_xla"]
        lines.append(
            f"| {setting} | {devices} | {ours['step_seconds'] / theirs['step_seconds']:.3f} | "
            f"{ours['first_step_seconds'] / theirs['first_step_seconds']:.3f} | "
            f"{_ratio(ours, theirs, 'ready_seconds')} | "
            f"{ours['graphs_compiled']} vs {theirs['graphs_compiled']} | "
            f"{ours['collective_bytes'] / ours['analytic']['min_collective_bytes']:.4f} | "
            f"{ours['peak_bytes'] / theirs['peak_bytes']:.3f} | "
            f"{ours['peak_bytes'] / ours['analytic']['min_peak_bytes']:.3f} |")
    lines.append("")
    for (setting, devices), pair in _pairs(results):
        ours, theirs = pair["xla_fsdp"], pair["torch_xla"]
        bound = ours["analytic"]
        lines += [f"## {setting}, N = {devices}", "",
                  f"{bound['params'] / 1e6:.1f} M parameters in {bound['units']} units, "
                  f"largest {bound['largest_unit'] / 1e6:.2f} M.", "",
                  "| | xla_fsdp | torch_xla | ours/theirs | target |",
                  "| --- | --- | --- | --- | --- |"]

        def ratio_row(label, key, fmt, target=None, scale=1.0):
            a, b = ours[key] * scale, theirs[key] * scale
            r = a / b if b else float("nan")
            t = "" if target is None else f"<= {target} ({_verdict(r <= target)})"
            lines.append(f"| {label} | {a:{fmt}} | {b:{fmt}} | {r:.3f} | {t} |")

        ratio_row("median step time (s)", "step_seconds", ".3f", 0.85)
        ratio_row("time to first step (s)", "first_step_seconds", ".2f", 0.8)
        if "ready_seconds" in ours:  # runs saved before it was reported lack it
            ratio_row("... counted from the start of wrapping (s)", "ready_seconds", ".2f", 0.8)
        ratio_row("second step (s; compiles the graph with optimizer state)",
                  "second_step_seconds", ".2f")
        ratio_row("wrapping the model (s)", "wrap_seconds", ".2f")
        a, b = ours["graphs_compiled"], theirs["graphs_compiled"]
        lines.append(f"| graphs compiled | {a} | {b} | {a / b:.3f} | <= theirs "
                     f"({_verdict(a <= b)}) |")
        a, b = ours["recompiles_after_step_2"], theirs["recompiles_after_step_2"]
        lines.append(f"| recompilations after step 2 | {a} | {b} | | 0 ({_verdict(a == 0)}) |")
        kinds = sorted(set(ours["collectives"]) | set(theirs["collectives"]))
        for kind in kinds:
            a = ours["collectives"].get(kind, {"count": 0})["count"]
            b = theirs["collectives"].get(kind, {"count": 0})["count"]
            lines.append(f"| {kind} per step | {a} | {b} | {a / b if b else float('nan'):.3f} | |")
        ratio_row("MB moved per step per rank", "collective_bytes", ".2f", scale=1 / MB)
        minimum = bound["min_collective_bytes"]
        a, b = ours["collective_bytes"] / minimum, theirs["collective_bytes"] / minimum
        lines.append(f"| ... over the analytic minimum ({minimum / MB:.2f} MB) | {a:.4f} | "
                     f"{b:.4f} | | <= 1.02 ({_verdict(a <= 1.02)}) |")
        a, b = ours["peak_bytes"], theirs["peak_bytes"]
        lines.append(f"| peak memory per rank (MB, XLA) | {a / MB:.1f} | {b / MB:.1f} | "
                     f"{a / b:.3f} | <= theirs ({_verdict(a <= b)}) |")
        minimum = bound["min_peak_bytes"]
        lines.append(f"| ... over the analytic minimum ({minimum / MB:.1f} MB) | "
                     f"{a / minimum:.3f} | {b / minimum:.3f} | | <= 1.25 "
                     f"({_verdict(a / minimum <= 1.25)}) |")
        diff = max(abs(x - y) for x, y in zip(ours["losses"], theirs["losses"]))
        lines += ["", f"Largest loss difference between the two over {len(ours['losses'])} "
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
            ax.bar([x + offset for x in xs], [p[impl][key] / scale for _, p in pairs], width,
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
