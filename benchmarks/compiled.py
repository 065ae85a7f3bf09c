"""The ``compiled`` setting: the benchmark's GPT (``scripts/bench/model.py``, every block a
unit, the root the rest) trained with xla_fsdp eagerly and under
``torch.compile(root, backend="openxla")``, and torch_xla's FSDP under the same compile,
side by side in one run.

    python benchmarks/compiled.py [--world 4] [--repeats 3] [--steps 8] [--layers 8] [--dim 512]

Each (wrapper, mode) trains in a fresh device process per repeat, so compile caches start
cold. Per rank 0, after ``WARM_UP`` steps (the figures are medians over those steps, then
over repeats):

- step time: wall time of a step, loss on the host;
- host per rank: CPU time of rank 0's thread over the step (tracing, Dynamo's guards,
  the bridge, dispatch); on virtual devices the other ranks' threads are not counted, nor
  is the autograd engine's thread, which runs the backward in both modes; "of which
  forward": over the model's call alone (the rest is mostly AdamW's lazy tracing, the
  same code in both modes);
- device: torch_xla's execute-time metric over the step, and the number of executions,
  both summed over all ranks (the metric is process-wide);
- Dynamo graphs and graph breaks: what Dynamo compiled in the whole run (each compiled
  graph runs once per step, so the breaks per step are the graphs run per step less one);
- first step: wall time of the first step (Dynamo, AOTAutograd and XLA compiling, plus one
  step's work), and XLA's compile time in the whole run;
- peak memory: the device process's resident-set high-water mark over the steps after
  warm-up (all ranks' buffers, one process), less what it held before them;
- compiles after warm-up (Dynamo frames, XLA graphs), which must be 0.

Needs the installed package and the repository root on ``sys.path`` (run from the root).
Writes benchmarks/results/compiled.md (``--out`` for another file).
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import peak_added, reset_peak, step_parser, write_result  # noqa: E402

WARM_UP = 3
# "compiled": torch.compile(root), the gathers traced into the graph; "compiled blocks":
# each block compiled before it is wrapped (FSDP(torch.compile(block))), the graph-break path
RUNS = (("xla_fsdp", "eager"), ("xla_fsdp", "compiled"), ("xla_fsdp", "compiled blocks"),
        ("torch_xla", "compiled"))


def run_rank(rank, impl, mode, layers, dim, steps):
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met
    from torch._dynamo.utils import counters

    from scripts.bench.model import Config, batch, build_model, wrap

    cfg = Config(layers=layers, dim=dim, steps=steps)
    device = torch_xla.device()
    model = build_model(cfg)
    if mode == "compiled blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="openxla")
    model = wrap(model, impl, "defaults")
    if mode == "compiled":
        model = torch.compile(model, backend="openxla")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def execute():
        data = met.metric_data("ExecuteTime")
        return (data[0], data[1] / 1e9) if data else (0, 0.0)

    out = {k: [] for k in ("wall", "host", "forward_host", "executions", "device", "losses",
                           "dynamo", "xla_compiles")}
    baseline = 0
    for step in range(steps):
        if step == WARM_UP and rank == 0:
            baseline = reset_peak()
        x, y = (t.to(device) for t in batch(cfg, rank, step))
        frames, compiles = counters["frames"]["ok"], met.counter_value("UncachedCompile") or 0
        (count, seconds), start, cpu = execute(), time.perf_counter(), time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        out["forward_host"].append(time.thread_time() - cpu)
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        out["losses"].append(loss.item())
        out["host"].append(time.thread_time() - cpu)
        out["wall"].append(time.perf_counter() - start)
        count2, seconds2 = execute()
        out["executions"].append(count2 - count)
        out["device"].append(seconds2 - seconds)
        out["dynamo"].append(counters["frames"]["ok"] - frames)
        out["xla_compiles"].append((met.counter_value("UncachedCompile") or 0) - compiles)
    out["peak"] = peak_added(baseline) if rank == 0 else 0
    out["graphs"] = counters["stats"]["unique_graphs"]
    out["breaks"] = sum(counters["graph_break"].values())
    out["xla_compile_seconds"] = (met.metric_data("CompileTime") or (0, 0))[1] / 1e9
    return out


def measure(impl, mode, args):
    from xla_fsdp import launch
    runs, error = [], None
    for _ in range(args.repeats):
        try:
            got = launch(run_rank, (impl, mode, args.layers, args.dim, args.steps),
                         num_devices=args.world)
        except Exception as exc:  # noqa: BLE001 - a competitor that fails is a result
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            error = lines[-1][:200] if lines else type(exc).__name__  # the rank's own error
            break
        runs.append(got[0])
    return runs, error


def summary(runs):
    def med(key):  # the median over steady steps, then over repeats
        return statistics.median(statistics.median(r[key][WARM_UP:]) for r in runs)
    steady = med("wall")
    return {
        "step": steady, "host": med("host"), "forward_host": med("forward_host"),
        "device": med("device"),
        "executions": med("executions"),
        "graphs": runs[0]["graphs"], "breaks": runs[0]["breaks"],
        "first": statistics.median(r["wall"][0] for r in runs),
        "xla_compile": statistics.median(r["xla_compile_seconds"] for r in runs),
        "peak": statistics.median(r["peak"] for r in runs) / 2**20,
        "late": max(sum(r["dynamo"][WARM_UP:]) + sum(r["xla_compiles"][WARM_UP:])
                    for r in runs),
        "losses": runs[0]["losses"],
    }


def main():
    ap = step_parser("compiled.md")
    args = ap.parse_args()
    results = {}
    for impl, mode in RUNS:
        runs, error = measure(impl, mode, args)
        results[(impl, mode)] = summary(runs) if runs else error
        print(impl, mode, results[(impl, mode)], flush=True)
    eager = results[("xla_fsdp", "eager")]
    lines = [f"# torch.compile on FSDP: eager against compiled (N = {args.world})", "",
             f"`python benchmarks/compiled.py --world {args.world} --repeats {args.repeats} "
             f"--steps {args.steps} --layers {args.layers} --dim {args.dim}`; the benchmark's "
             f"GPT, AdamW, medians over steps {WARM_UP + 1}-{args.steps} and "
             f"{args.repeats} fresh processes. Ratios are compiled / eager.", "",
             "| wrapper, mode | step s | host s per rank | of which forward | device s (all ranks) "
             "| executions (all ranks) | Dynamo graphs | graph breaks | first step s "
             "| XLA compile s | peak MiB after warm-up | compiles after warm-up |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (impl, mode), r in results.items():
        if isinstance(r, str):
            lines.append(f"| {impl}, {mode} | failed: {r} |" + " |" * 10)
            continue
        lines.append(
            f"| {impl}, {mode} | {r['step']:.3f} | {r['host']:.3f} | {r['forward_host']:.3f} | "
            f"{r['device']:.3f} | "
            f"{r['executions']:.0f} | {r['graphs']} | {r['breaks']} | {r['first']:.1f} | "
            f"{r['xla_compile']:.1f} | {r['peak']:.0f} | {r['late']} |")
    ratios = [(mode, r) for (impl, mode), r in results.items()
              if impl == "xla_fsdp" and mode != "eager" and not isinstance(r, str)]
    if ratios and not isinstance(eager, str):
        lines += ["", "| ratio to eager | step | host | forward host | device | executions | "
                      "peak |", "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| xla_fsdp, {mode} | {r['step'] / eager['step']:.2f} | "
                  f"{r['host'] / eager['host']:.2f} | "
                  f"{r['forward_host'] / eager['forward_host']:.2f} | "
                  f"{r['device'] / eager['device']:.2f} | "
                  f"{r['executions'] / eager['executions']:.1f} | "
                  f"{r['peak'] / eager['peak']:.2f} |" for mode, r in ratios]
        lines += [""] + [
            f"Largest loss difference, {mode} against eager, over {args.steps} steps: "
            f"{max(abs(a - b) for a, b in zip(r['losses'], eager['losses'])):.2e}."
            for mode, r in ratios]
    write_result(args.out, lines)


if __name__ == "__main__":
    main()
