"""Llama-3.1-8B's shape, AdamW full fine-tuning with bf16 compute, planned by libtpu for a
v5e-8 (and a v6e-8): ours with and without ``offload_optimizer=True``, torch_xla's FSDP
(its ``compute_dtype``) and FSDPv2 (the float32 model's forward under
``torch.autocast("xla", dtype=torch.bfloat16)``: it has no compute dtype of its own).
Every figure is the compiler's (argument / output / temp / peak bytes per chip), never a
measurement.

    python -m scripts.bench.offload_plan                           # 1024 tokens/chip
    python -m scripts.bench.offload_plan --act-ckpt --seq 2048     # + checkpointing

Builds on ``scripts.bench.tpu_plan``: its shapes, ``Setting`` (with activation checkpointing
per decoder layer and autocast) and ``train_step``. Each
implementation is traced once and the trace compiled for every slice side by side (a
libtpu process each). The planning process's peak RSS is read after each trace (the traced child's, the largest so far: the offloaded
plan is traced first so its figure is its own) and after the compiles.
Results go to ``benchmarks/results/offload/``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

from scripts.bench.tpu_plan import SHAPES, Setting, train_step

OUT = os.path.join("benchmarks", "results", "offload")
# label -> (impl, offload): the offloaded run first (see the RSS note above)
RUNS = {"xla_fsdp+offload": ("xla_fsdp", True), "xla_fsdp": ("xla_fsdp", False),
        "torch_xla": ("torch_xla", False), "fsdpv2": ("fsdpv2", False)}


def setting_for(label: str, shape: str, layers: int, seq: int, act_ckpt: bool,
                steps: int = 3, fsdpv2_attention: str = "eager") -> Setting:
    """bf16 compute for every implementation, by the means each has. FSDPv2's is autocast,
    whose XLA policy leaves ``scaled_dot_product_attention`` out: Hugging Face's sdpa
    attention then gets float32 queries and keys (rotary embeddings promote them) and a
    bfloat16 value, and refuses ("Expected query, key, and value to have the same dtype"),
    on a TPU as here; so FSDPv2 runs with eager attention by default, as a user would."""
    import torch
    impl, offload = RUNS[label]
    options: tuple = ()
    if impl in ("xla_fsdp", "torch_xla"):
        options = (("compute_dtype", torch.bfloat16),)
    if offload:
        options += (("offload_optimizer", True),)
    return Setting(impl, shape, layers, seq, steps=steps, options=options,
                          act_ckpt=act_ckpt, autocast=impl == "fsdpv2",
                          attention=fsdpv2_attention if impl == "fsdpv2" else "")


def _max_rss() -> dict:
    return {"self_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "children_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


_DOT = re.compile(r"= (\w+)\[[^\]]*\][^ ]* (?:dot|convolution)\(")


def _dot_dtypes(hlo: List[str]) -> dict:
    """How many dots the traced step has, by result dtype: bf16 compute shows here."""
    counts: dict = {}
    for text in hlo:
        for dtype in _DOT.findall(text):
            counts[dtype] = counts.get(dtype, 0) + 1
    return counts


def plan(label: str, setting: Setting, topologies: List[str]) -> List[dict]:
    from xla_fsdp.aot.plan import report_for, trace_step
    from xla_fsdp.aot.topology import resolve
    slices = [resolve(t) for t in topologies]
    assert len({s.chips for s in slices}) == 1, "one trace serves slices of one size"
    started = time.monotonic()
    traced = trace_step(train_step, (setting,), slices[0].chips)
    traced_seconds = time.monotonic() - started
    rss_after_trace = _max_rss()
    with ThreadPoolExecutor(len(slices)) as pool:   # a libtpu process each, side by side
        reports = list(pool.map(lambda s: report_for(traced, s), slices))
    rss_after_compile = _max_rss()
    rows = []
    for r in reports:
        row = {"label": label, "impl": setting.impl, "shape": setting.shape,
               "layers": setting.layers, "seq": setting.seq, "act_ckpt": setting.act_ckpt,
               "autocast": setting.autocast, "attention": setting.attention or "sdpa",
               "options": [[k, str(v)] for k, v in setting.options],
               "topology": r.topology.cloud_name, "fits": r.fits,
               "peak_bytes": r.peak_bytes, "argument_bytes": r.argument_bytes,
               "output_bytes": r.output_bytes, "alias_bytes": r.alias_bytes,
               "temp_bytes": r.temp_bytes, "required_bytes": r.required_bytes,
               "usable_bytes": r.usable_hbm_bytes, "hbm_bytes": r.hbm_bytes,
               "programs": r.programs, "graph_outputs": [g.outputs for g in traced.graphs],
               "graph_donated": [g.donated for g in traced.graphs],
               "syncs_traced": traced.syncs, "repeated": traced.repeated,
               "dots_by_dtype": _dot_dtypes(r.hlo), "message": r.message, "notes": r.notes,
               "compile_seconds": r.compile_seconds, "trace_seconds": traced_seconds,
               "rss_after_trace": rss_after_trace, "rss_after_compile": rss_after_compile}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "message"}), flush=True)
        if r.message:
            print(r.message[:3000], flush=True)
    return rows


def _gib(value: int) -> str:
    return f"{value / 2 ** 30:.2f}"


def _markdown(rows: List[dict], command: str) -> str:
    lines = ["| impl | slice | tokens/chip | act ckpt | fits | peak GiB | argument GiB | "
             "output GiB | temp GiB | programs/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["fits"]:
            peak, arg, out, temp = (_gib(r[k]) for k in
                                    ("peak_bytes", "argument_bytes", "output_bytes",
                                     "temp_bytes"))
        else:
            peak, arg, out, temp = f"needs {_gib(r['required_bytes'])}", "-", "-", "-"
        label = r["label"] + (f" ({r['attention']} attention)" if r.get("autocast") else "")
        lines.append(f"| {label} | {r['topology']} | {r['seq']} | "
                     f"{'yes' if r['act_ckpt'] else 'no'} | {'yes' if r['fits'] else 'no'} | "
                     f"{peak} | {arg} | {out} | {temp} | {r['programs']} |")
    return f"`{command}`\n\n" + "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b", help=f"of {list(SHAPES)}")
    parser.add_argument("--layers", type=int, help="override the shape's depth")
    parser.add_argument("--topologies", nargs="+", default=["v5e-8", "v6e-8"])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), help=f"of {list(RUNS)}")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per chip")
    parser.add_argument("--act-ckpt", action="store_true",
                        help="checkpoint each decoder layer (each implementation's own way)")
    parser.add_argument("--fsdpv2-attention", default="eager",
                        help="FSDPv2's attn_implementation (sdpa fails under XLA autocast)")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--name", default="tpu_8b", help="results file stem")
    ns = parser.parse_args(argv)
    command = "python -m scripts.bench.offload_plan " + shlex.join(argv)
    layers = ns.layers or SHAPES[ns.shape]["num_hidden_layers"]
    rows: List[dict] = []
    os.makedirs(ns.out, exist_ok=True)
    for label in ns.runs:
        rows += plan(label, setting_for(label, ns.shape, layers, ns.seq, ns.act_ckpt,
                                 fsdpv2_attention=ns.fsdpv2_attention),
                     ns.topologies)
        with open(os.path.join(ns.out, ns.name + ".json"), "w") as f:   # after each run
            json.dump({"command": command, "rows": rows}, f, indent=1)
    print(_markdown(rows, command))


if __name__ == "__main__":
    main()
