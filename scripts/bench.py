"""Training-step benchmark: xla_fsdp against torch_xla's own FSDP, side by side.

    python scripts/bench.py [--devices 4 8] [--repeats 3] [--steps 8]

Both wrap the same GPT (each block a unit, the rest in the root), start from the same
weights, see the same batches and run AdamW, on N virtual XLA:CPU devices under
``xla_fsdp.launch``. In the ``defaults`` setting torch_xla's SPMD FSDPv2 is a third
competitor: one process holding the N devices, the same global batch sharded along the batch
dimension (``scripts/bench_spmd.py``). torch_xla's FSDP runs with
``pin_layout_in_collective_ops=False`` because its pinned all-gather cannot run on virtual
devices; xla_fsdp runs with its defaults. Every run is a fresh process (so compilation is
measured), and the order alternates between repetitions. Per implementation and device
count, one extra *inspection* run dumps the step graph's HLO (collectives, bytes they move)
and XLA's compiled-program memory statistics; its timings are not used.

Writes ``benchmarks/results/train_step.md`` and ``train_step.png``.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from unittest import mock
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from train_lm import Block  # noqa: E402  (the example's transformer block)
from xla_fsdp import launch  # noqa: E402

IMPLS = ("xla_fsdp", "torch_xla")
SPMD_IMPLS = ("fsdpv2", "fsdpv2_scan")  # one SPMD process, see bench_spmd.py
SPMD_SETTINGS = ("defaults",)  # FSDPv2 has none of the other settings' options
# Wrapper options, the same for both implementations. The first two are the comparison; the
# others are levers measured on their own (see benchmarks/results/levers/).
SETTINGS = {"defaults": {}, "flattened": {"flatten_parameters": True},
            "coalesced": {"coalesce_all_gather_ops": True},
            "flattened_coalesced": {"flatten_parameters": True, "coalesce_all_gather_ops": True},
            "no_barriers": {"optimization_barrier_in_forward": False,
                            "optimization_barrier_in_backward": False},
            # controls only xla_fsdp has; torch_xla runs the same options without them
            "prefetch": {"controls": ("prefetch",)},
            "grouped": {"controls": ("grouped",)}}
COMPARISON = ["defaults", "flattened"]


@dataclass(frozen=True)
class Config:
    layers: int = 8
    dim: int = 512
    heads: int = 8
    vocab: int = 8192
    seq: int = 128
    batch: int = 1           # sequences per rank
    steps: int = 8
    lr: float = 1e-4
    seed: int = 0


# -- the model ------------------------------------------------------------------------------
class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList([Block(cfg.dim, cfg.heads) for _ in range(cfg.layers)])
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.scan_layers = False  # True: torch_xla's scan_layers instead of the loop

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        if self.scan_layers:
            from torch_xla.experimental.scan_layers import scan_layers
            # pure: the layer is traced by AOTAutograd once, not again every step
            x = scan_layers(self.blocks, x, is_layer_pure=True)
        else:  # a ScannedLayers yields one callable that runs every layer
            for block in self.blocks:
                x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg: Config) -> GPT:
    torch.manual_seed(cfg.seed)
    return GPT(cfg)


def unit_sizes(cfg: Config) -> List[int]:
    """Parameter counts of the FSDP units: every block, then the root (the rest)."""
    model = build_model(cfg)
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    total = sum(p.numel() for p in model.parameters())
    return blocks + [total - sum(blocks)]


def batch(cfg: Config, rank: int, step: int) -> tuple:
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# -- one run, on every rank -----------------------------------------------------------------
def wrap(model: GPT, impl: str, setting: str) -> nn.Module:
    """``impl`` "xla_fsdp_scanned": the blocks one ``ScannedLayers`` unit, then the root."""
    options = dict(SETTINGS[setting])
    if impl == "xla_fsdp_scanned":
        from xla_fsdp import FSDP, ScannedLayers  # ImportError: the variant is unavailable
        options.pop("controls", None)
        model.blocks = ScannedLayers(model.blocks, **options)
        return FSDP(model, **options)
    controls = options.pop("controls", ()) if impl == "xla_fsdp" else ()
    options.pop("controls", None)
    if impl == "xla_fsdp":
        from xla_fsdp import FSDP
        from xla_fsdp.wrap import transformer_auto_wrap_policy
    else:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        options["pin_layout_in_collective_ops"] = False
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    if "grouped" in controls:
        # FSDP2's layout: the embedding its own unit, the final norm and the head one unit
        # (gathered at the end of forward and kept for backward, which starts with them),
        # so the root, which never reshards, holds only the position table
        model.embed = FSDP(model.embed, **options)
        tail = FSDP([model.ln, model.head], **options)
        tail.set_reshard_after_forward(False)
    root = FSDP(model, auto_wrap_policy=policy, **options)
    if "prefetch" in controls:  # each block's gather is issued with the previous unit's
        blocks = list(model.blocks)
        root.set_modules_to_forward_prefetch(blocks[:1])
        root.set_modules_to_backward_prefetch(blocks[-1:])
        for before, after in zip(blocks, blocks[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    return root


def run_rank(rank: int, impl: str, setting: str, cfg: Config,
             marks_dir: Optional[str], launched_at: float = 0.0) -> dict:
    """Trains ``cfg.steps`` steps on one rank; see ``train``."""
    import torch_xla
    device = torch_xla.device()

    def make_batch(step):
        return tuple(t.to(device) for t in batch(cfg, rank, step))

    def build():
        model = wrap(build_model(cfg), impl, setting)
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    return train(build, make_batch, cfg.steps, marks_dir if rank == 0 else None, launched_at)


def _metric(name: str) -> tuple:
    """(count, seconds) of a torch_xla timing metric, process-wide."""
    import torch_xla.debug.metrics as met
    data = met.metric_data(name)
    return (data[0], data[1] / 1e9) if data else (0, 0.0)


EXECUTE_METRICS = ("ExecuteTime", "ExecuteReplicatedTime")  # per-rank graphs; SPMD


def train(build, make_batch, steps: int, marks_dir: Optional[str],
          launched_at: float) -> dict:
    """Builds (model, optimizer) with ``build()`` and trains ``steps`` steps; returns per-step
    wall times, losses, compile counts and the phases of each step:

    - ``host``: CPU time of this thread from the step's start until ``torch_xla.sync()``
      returns: tracing forward, backward and the optimizer, hashing the graph, compiling it
      when new, launching it. Other ranks' threads are not counted;
    - ``dispatch``: wall time of the same span. On virtual devices it also holds the other
      ranks' tracing (one GIL, and the launcher's sync waits for every rank);
    - ``wait``: wall time from there until the loss is on the host: the device executing;
    - ``execute``: torch_xla's execute-time metric for the step, per execution.

    ``startup_seconds``: from ``launched_at`` (``time.time()`` in the parent before it
    started the process) until the first step is done. With ``marks_dir``, notes which HLO
    dumps and which part of torch_xla's debug file belong to step 2, the first step with
    optimizer state: its graph is the one every later step reuses."""
    import torch_xla
    import torch_xla.debug.metrics as met

    def compiles() -> int:
        return int(met.counter_value("UncachedCompile") or 0)

    def executions() -> tuple:
        got = [_metric(m) for m in EXECUTE_METRICS]
        return sum(c for c, _ in got), sum(t for _, t in got)

    t0 = time.perf_counter()
    model, optimizer = build()
    wrap_seconds = time.perf_counter() - t0
    compiles_at_start = compiles()
    out = {k: [] for k in ("times", "losses", "compile_counts", "host", "dispatch", "wait",
                           "execute")}
    for step in range(steps):
        x, y = make_batch(step)
        if marks_dir and step == 1:
            _mark(marks_dir, "before")
        before = executions()
        start, cpu = time.perf_counter(), time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        dispatched, cpu = time.perf_counter(), time.thread_time() - cpu
        out["losses"].append(loss.item())
        end = time.perf_counter()
        count, seconds = (a - b for a, b in zip(executions(), before))
        if step == 0:
            out["startup_seconds"] = time.time() - launched_at
        for key, value in (("times", end - start), ("host", cpu), ("wait", end - dispatched),
                           ("dispatch", dispatched - start),
                           ("execute", seconds / count if count else 0.0),
                           ("compile_counts", compiles())):
            out[key].append(value)
        if step == 0:
            out["compile_seconds_step_1"] = _metric("CompileTime")[1]
        if marks_dir and step == 1:
            _mark(marks_dir, "after")
    return dict(out, wrap_seconds=wrap_seconds, compiles_at_start=compiles_at_start,
                compile_seconds=_metric("CompileTime")[1])


def _debug_file(marks_dir: str) -> str:
    return os.path.join(marks_dir, "debug.txt")


def _mark(marks_dir: str, label: str) -> None:
    debug_file = _debug_file(marks_dir)
    state = {"dumps": sorted(os.listdir(os.path.join(marks_dir, "dump"))),
             "debug_bytes": os.path.getsize(debug_file) if os.path.exists(debug_file) else 0}
    with open(os.path.join(marks_dir, f"{label}.json"), "w") as f:
        json.dump(state, f)


# -- reading the step graph ----------------------------------------------------------------
_COLLECTIVE = re.compile(
    # a tuple's shape may carry /*index=5*/ markers, the only '=' allowed before the op
    r"=\s*(?P<shape>\((?:/\*index=\d+\*/|[^=])*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
    r"(?:-start)?\(")
_ARRAY = re.compile(r"(?P<dtype>pred|[a-z]+\d+)\[(?P<dims>[0-9,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def _array_bytes(text: str) -> int:
    total = 0
    for m in _ARRAY.finditer(text):
        dims = [int(d) for d in m.group("dims").split(",") if d]
        total += math.prod(dims) * _DTYPE_BYTES[m.group("dtype")]
    return total


def collectives_in_hlo(hlo: str, world: int) -> Dict[str, dict]:
    """Count and bytes each rank sends per collective kind, for a ring implementation:
    an all-gather or reduce-scatter moves (N-1)/N of its full-size side (the result of an
    all-gather, N times the result of a reduce-scatter), an all-reduce twice that."""
    out: Dict[str, dict] = {}
    share = (world - 1) / world
    for m in _COLLECTIVE.finditer(hlo):
        op = m.group("op")
        result = _array_bytes(m.group("shape"))
        if op == "all-gather":
            moved = share * result
        elif op == "reduce-scatter":
            moved = share * result * world
        elif op == "all-reduce":
            moved = 2 * share * result
        else:
            moved = result
        entry = out.setdefault(op, {"count": 0, "bytes": 0.0})
        entry["count"] += 1
        entry["bytes"] += moved
    return out


def step_graph(marks_dir: str, suffix: str = ".before_optimizations.txt") -> dict:
    """The HLO and memory statistics of the graph compiled in step 2. An SPMD program is
    read after optimizations (``suffix``): only the partitioned per-device program has the
    collectives, and XLA's memory statistics are those of that per-device program."""
    with open(os.path.join(marks_dir, "before.json")) as f:
        before = json.load(f)
    with open(os.path.join(marks_dir, "after.json")) as f:
        after = json.load(f)
    new = sorted(set(after["dumps"]) - set(before["dumps"]))
    modules = [n for n in new if n.endswith(suffix)]
    if not modules:
        raise RuntimeError("no graph was compiled in step 2")
    texts = {}
    for name in modules:
        with open(os.path.join(marks_dir, "dump", name)) as f:
            texts[name] = f.read()
    biggest = max(texts, key=lambda n: len(texts[n]))
    with open(_debug_file(marks_dir), "rb") as f:
        f.seek(before["debug_bytes"])
        debug = f.read(after["debug_bytes"] - before["debug_bytes"]).decode()
    stats = memory_stats(debug)
    if len(stats) != len(modules):
        raise RuntimeError(f"{len(modules)} graphs compiled in step 2 but {len(stats)} memory "
                           f"reports found")
    return {"graphs_in_step_2": len(modules), "hlo": texts[biggest],
            "peak_bytes": max(peak_of(s) for s in stats), "memory": stats}


def memory_stats(debug: str) -> List[dict]:
    """The compiled-program memory reports (GB) in torch_xla's ``PT_XLA_DEBUG_LEVEL=2`` text."""
    return [dict(zip(("input", "output", "aliased", "temp"), map(float, m)))
            for m in re.findall(r"Graph input size: ([\d.]+) GB\n.*?Graph output size: ([\d.]+)"
                                r" GB\n.*?Aliased Input size: ([\d.]+) GB\n.*?Intermediate "
                                r"tensor size: ([\d.]+) GB", debug, re.S)]


def peak_of(stats: dict) -> float:
    """Bytes live at once in a program: arguments + outputs - aliased + temporaries."""
    return (stats["input"] + stats["output"] - stats["aliased"] + stats["temp"]) * 2**30


# -- the driver ----------------------------------------------------------------------------
def _launch_impl(impl: str, setting: str, cfg: Config, devices: int,
                 marks_dir: Optional[str]) -> dict:
    """One fresh process; rank 0's result, with every rank's losses and host times."""
    launched_at = time.time()
    if impl in SPMD_IMPLS:
        from bench_spmd import run_spmd, spmd_launch
        run = spmd_launch(run_spmd, (impl, cfg, marks_dir, launched_at), devices)
        return dict(run, global_losses=run["losses"], host_per_rank=[run["host"]])
    ranks = launch(run_rank, (impl, setting, cfg, marks_dir, launched_at), num_devices=devices)
    # ranks see different batches of the same size: the global loss is their mean
    losses = [statistics.fmean(step) for step in zip(*(r["losses"] for r in ranks.values()))]
    return dict(ranks[0], global_losses=losses, host_per_rank=[r["host"] for r in ranks.values()])


def one_run(impl: str, setting: str, cfg: Config, devices: int, inspect: bool) -> dict:
    if not inspect:
        return _launch_impl(impl, setting, cfg, devices, None)
    marks_dir = tempfile.mkdtemp(prefix="xla_fsdp_bench_")
    os.makedirs(os.path.join(marks_dir, "dump"))
    env = {"XLA_FLAGS": f"--xla_dump_to={marks_dir}/dump --xla_dump_hlo_as_text",
           "PT_XLA_DEBUG_LEVEL": "2", "PT_XLA_DEBUG_FILE": _debug_file(marks_dir)}
    try:
        with mock.patch.dict(os.environ, env):  # the device process inherits them
            run = _launch_impl(impl, setting, cfg, devices, marks_dir)
        suffix = ".cpu_after_optimizations.txt" if impl in SPMD_IMPLS else None
        return dict(run, graph=step_graph(marks_dir, *([suffix] if suffix else [])))
    finally:
        shutil.rmtree(marks_dir, ignore_errors=True)


def phases(runs: List[dict], warmup: int) -> dict:
    """Medians over runs of each run's median over its steps after ``warmup``; the host time
    is a rank's own (the median over ranks)."""
    def med(key):
        return statistics.median(statistics.median(r[key][warmup:]) for r in runs)
    return {
        "step_seconds": med("times"), "dispatch_seconds": med("dispatch"),
        "wait_seconds": med("wait"), "execute_seconds": med("execute"),
        "host_seconds": statistics.median(
            statistics.median(statistics.median(h[warmup:]) for h in r["host_per_rank"])
            for r in runs),
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


def impls_for(setting: str, wanted) -> List[str]:
    """The competitors of a setting: FSDPv2 only where its options are the same."""
    return [i for i in wanted if i not in SPMD_IMPLS or setting in SPMD_SETTINGS]


def measure(setting: str, devices: int, cfg: Config, args: argparse.Namespace,
            impls=None) -> List[dict]:
    from xla_fsdp.launch import LaunchError
    impls = list(impls or impls_for(setting, args.impls))
    runs: Dict[str, List[dict]] = {impl: [] for impl in impls}
    inspections, crashes = {}, {}
    for impl in impls:
        print(f"{setting} N={devices} {impl}: inspection run", flush=True)
        try:
            if args.inspect:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS),
                        default=COMPARISON, help="wrapper options, the same for both")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS) + ["fsdpv2"],
                        choices=list(IMPLS) + list(SPMD_IMPLS),
                        help="competitors (FSDPv2 variants only in the defaults setting)")
    parser.add_argument("--no-inspect", dest="inspect", action="store_false",
                        help="skip the inspection runs (no HLO, no memory)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3,
                        help="steps left out of the step-time median (compilation happens in "
                             "steps 1 and 2)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
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
    from bench_report import markdown_report, plot
    text = markdown_report(args, cfg, results, machine())
    with open(os.path.join(args.out, "train_step.md"), "w") as f:
        f.write(text)
    plot(results, os.path.join(args.out, "train_step.png"))
    print(text)


def machine() -> str:
    import torch_xla
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"torch_xla {torch_xla.__version__}")


if __name__ == "__main__":
    main()
