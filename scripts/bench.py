"""Training-step benchmark: xla_fsdp against torch_xla's own FSDP, side by side.

    python scripts/bench.py [--devices 4 8] [--repeats 3] [--steps 8]

Both wrap the same GPT (each block a unit, the rest in the root), start from the same
weights, see the same batches and run AdamW, on N virtual XLA:CPU devices under
``xla_fsdp.launch``. torch_xla's runs with ``pin_layout_in_collective_ops=False`` because
its pinned all-gather cannot run on virtual devices; xla_fsdp runs with its defaults. Every
run is a fresh process (so compilation is measured), and the order alternates between
repetitions. Per implementation and device count, one extra *inspection* run dumps the step
graph's HLO (collectives, bytes they move) and XLA's compiled-program memory statistics;
its timings are not used.

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
        self.blocks = nn.Sequential(*[Block(cfg.dim, cfg.heads) for _ in range(cfg.layers)])
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        logits = self.head(self.ln(self.blocks(x)))
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
    options = dict(SETTINGS[setting])
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
             marks_dir: Optional[str]) -> dict:
    """Trains ``cfg.steps`` steps; returns per-step wall times, losses and compile counts.

    With ``marks_dir`` (inspection runs), rank 0 notes which HLO dumps and which part of
    torch_xla's debug file belong to step 2, the first step with optimizer state: its graph
    is the one every later step reuses."""
    import torch_xla
    import torch_xla.debug.metrics as met

    def compiles() -> int:
        return int(met.counter_value("UncachedCompile") or 0)

    device = torch_xla.device()
    t0 = time.perf_counter()
    model = wrap(build_model(cfg), impl, setting)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    wrap_seconds = time.perf_counter() - t0
    compiles_at_start = compiles()
    times, losses, compile_counts = [], [], []
    for step in range(cfg.steps):
        x, y = batch(cfg, rank, step)
        if marks_dir and rank == 0 and step == 1:
            _mark(marks_dir, "before")
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(x.to(device), y.to(device))
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        compile_counts.append(compiles())
        if marks_dir and rank == 0 and step == 1:
            _mark(marks_dir, "after")
    return {"wrap_seconds": wrap_seconds, "times": times, "losses": losses,
            "compiles_at_start": compiles_at_start, "compile_counts": compile_counts}


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


def step_graph(marks_dir: str) -> dict:
    """The HLO and memory statistics of the graph compiled in step 2."""
    with open(os.path.join(marks_dir, "before.json")) as f:
        before = json.load(f)
    with open(os.path.join(marks_dir, "after.json")) as f:
        after = json.load(f)
    new = sorted(set(after["dumps"]) - set(before["dumps"]))
    modules = [n for n in new if n.endswith(".before_optimizations.txt")]
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
    stats = [dict(zip(("input", "output", "aliased", "temp"), map(float, m)))
             for m in re.findall(r"Graph input size: ([\d.]+) GB\n.*?Graph output size: ([\d.]+)"
                                 r" GB\n.*?Aliased Input size: ([\d.]+) GB\n.*?Intermediate "
                                 r"tensor size: ([\d.]+) GB", debug, re.S)]
    if len(stats) != len(modules):
        raise RuntimeError(f"{len(modules)} graphs compiled in step 2 but {len(stats)} memory "
                           f"reports found")
    peak = max((s["input"] + s["output"] - s["aliased"] + s["temp"]) * 2**30 for s in stats)
    return {"graphs_in_step_2": len(modules), "hlo": texts[biggest], "peak_bytes": peak,
            "memory": stats}


# -- the driver ----------------------------------------------------------------------------
def one_run(impl: str, setting: str, cfg: Config, devices: int, inspect: bool) -> dict:
    if not inspect:
        return launch(run_rank, (impl, setting, cfg, None), num_devices=devices)[0]
    marks_dir = tempfile.mkdtemp(prefix="xla_fsdp_bench_")
    os.makedirs(os.path.join(marks_dir, "dump"))
    env = {"XLA_FLAGS": f"--xla_dump_to={marks_dir}/dump --xla_dump_hlo_as_text",
           "PT_XLA_DEBUG_LEVEL": "2", "PT_XLA_DEBUG_FILE": _debug_file(marks_dir)}
    try:
        with mock.patch.dict(os.environ, env):  # the device process inherits them
            run = launch(run_rank, (impl, setting, cfg, marks_dir), num_devices=devices)[0]
        return dict(run, graph=step_graph(marks_dir))
    finally:
        shutil.rmtree(marks_dir, ignore_errors=True)


def summarize(impl: str, setting: str, runs: List[dict], inspection: dict, cfg: Config,
              devices: int, warmup: int) -> dict:
    steady = [statistics.median(r["times"][warmup:]) for r in runs]
    counts = [r["compile_counts"] for r in runs]
    coll = collectives_in_hlo(inspection["graph"]["hlo"], devices)
    return {
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
        "losses": runs[0]["losses"],
    }


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


def measure(setting: str, devices: int, cfg: Config, args: argparse.Namespace) -> List[dict]:
    from xla_fsdp.launch import LaunchError
    runs: Dict[str, List[dict]] = {impl: [] for impl in IMPLS}
    inspections, crashes = {}, {}
    for impl in IMPLS:
        print(f"{setting} N={devices} {impl}: inspection run", flush=True)
        try:
            inspections[impl] = one_run(impl, setting, cfg, devices, inspect=True)
        except LaunchError as error:  # a wrapper that dies in a setting is a result too
            crashes[impl] = str(error).splitlines()[0]
            print(f"{setting} N={devices} {impl}: {crashes[impl]}", flush=True)
    running = [impl for impl in IMPLS if impl not in crashes]
    for rep in range(args.repeats):
        for impl in (running if rep % 2 == 0 else running[::-1]):
            run = one_run(impl, setting, cfg, devices, inspect=False)
            print(f"{setting} N={devices} {impl} rep {rep + 1}: step "
                  f"{statistics.median(run['times'][args.warmup:]):.3f} s, first "
                  f"{run['times'][0]:.1f} s, loss {run['losses'][-1]:.4f}", flush=True)
            runs[impl].append(run)
    bound = analytic(cfg, devices)
    crashed = [{"impl": impl, "setting": setting, "devices": devices, "crashed": why,
                "analytic": bound} for impl, why in crashes.items()]
    return crashed + [dict(summarize(impl, setting, runs[impl], inspections[impl], cfg,
                                     devices, args.warmup), analytic=bound) for impl in running]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS),
                        default=COMPARISON, help="wrapper options, the same for both")
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
                   "results": results}, f, indent=1)
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
