"""The planner's step-time estimate against TPU step times that others measured and published
with their whole configuration: torchprime's end-to-end tests (torch_xla SPMD on a v6e-4)
and MaxText's Llama 3.1 8B recipe for a v6e-8. Each run's step is compiled here by libtpu,
as that run configured it, and its schedule replayed by ``xla_fsdp.aot.step_time``; the
efficiencies of the model (``Efficiency``: fractions of the chip's peaks) are fitted to the
measurements, and every row's error is reported under the fit.

    python -m scripts.bench.tpu_calibration                      # every row, then the fit
    python -m scripts.bench.tpu_calibration --rows torchprime-flash ours
    python -m scripts.bench.maxtext_compile                      # MaxText's step, first

The rows (sources in ``MEASURED``):
* ``torchprime-flash``: torchprime's "Llama 3.0 8B" e2e test, traced through the planner's
  SPMD path as torchprime runs it: its Llama (Hugging Face's ``LlamaForCausalLM`` with the
  same dimensions), bf16 parameters, Hugging Face's Adafactor, one activation checkpoint
  and backward optimization barrier per decoder layer, torch_xla's Pallas flash attention
  with torchprime's block sizes and partition spec, the weights sharded per torchprime's
  ``llama-fsdp`` rules over a ``(data 1, fsdp 4, tensor 1, expert 1)`` mesh, the decoder
  layers' outputs sharded along the batch, 8 x 8,192 tokens per step;
* ``torchprime-splash``: its "Llama 3.1 8B (Splash Attention)" test: the same with Llama
  3.1's rotary scaling and torch_xla's splash attention;
* ``maxtext``: tpu-recipes' ``Llama3.1-8B-MaxText/v6e-8``, compiled by MaxText's own
  ``train_compile`` (``maxtext`` from the package index, in an environment of its own);
  its optimized HLO is replayed as ours are;
* ``ours`` (estimate only, nothing measured): torchprime's model and batch with
  ``xla_fsdp``: float32 master weights, bf16 compute, one unit and one activation
  checkpoint per decoder layer, the same flash attention and Adafactor.

What cannot be reproduced here: the libtpu each run had (torchprime: torch_xla's 2025-05-01
nightly; MaxText: jax 0.6.1's), whose schedules differ from libtpu 0.0.50.1's; and
``--xla_tpu_enable_async_collective_fusion=true``, which both runs set and this libtpu
refuses on v6e ("not supported/recommended on platforms other than TPU v5e"), so the
collectives that fusion would have overlapped are compiled synchronously here.

Results go to ``benchmarks/results/tpu_calibration/``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

OUT = os.path.join("benchmarks", "results", "tpu_calibration")
TORCHPRIME = "AI-Hypercomputer/torchprime@1d36d8002f825bd9513244f3e434ae2cc3af7af4"
RECIPE = ("AI-Hypercomputer/tpu-recipes training/trillium/Llama3.1-8B-MaxText/v6e-8 "
          "(README's log line at step 14; MaxText tag tpu-recipes-v0.1.4)")


@dataclass(frozen=True)
class Measured:
    seconds: float
    topology: str
    source: str


MEASURED: Dict[str, Measured] = {
    "torchprime-flash": Measured(2.7352, "v6e-4", f"{TORCHPRIME} e2e_testing/"
                                 "step_time_bounds.yaml, llama-3-8b: mean of 427 runs' "
                                 "median step periods"),
    "torchprime-splash": Measured(2.4068, "v6e-4", f"{TORCHPRIME} e2e_testing/"
                                  "step_time_bounds.yaml, llama-3_1-8b-sa: mean of 428 runs"),
    "maxtext": Measured(3.443, "v6e-8", RECIPE),
}
ROWS = ("torchprime-flash", "torchprime-splash", "maxtext", "ours")

# torchprime's launcher image (torchprime/launcher/Dockerfile), with the async collective
# fusion this libtpu refuses on v6e turned off
TORCHPRIME_LIBTPU = ("--xla_tpu_scoped_vmem_limit_kib=98304 --xla_enable_async_all_gather=true "
                     "--xla_tpu_overlap_compute_collective_tc=true "
                     "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
                     "--xla_tpu_enable_async_collective_fusion=false "
                     "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true")
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072)
LLAMA_31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# torchprime's torch_xla_models/attention.py
FLASH_BLOCKS = dict(block_q=2048, block_k_major=512, block_k=512, block_b=2,
                    block_q_major_dkv=2048, block_k_major_dkv=512, block_q_dkv=2048,
                    block_k_dkv=512, block_q_dq=2048, block_k_dq=256, block_k_major_dq=512)
# torchprime's model/sharding/llama-fsdp.yaml: (name fragment, spec), first match wins
SHARDING = (("embed_tokens", ("fsdp", None)), ("q_proj", ("fsdp", None)),
            ("k_proj", (None, "fsdp")), ("v_proj", (None, "fsdp")), ("o_proj", ("fsdp", None)),
            ("gate_proj", ("fsdp", None)), ("up_proj", ("fsdp", None)),
            ("down_proj", (None, "fsdp")), ("layernorm", ("fsdp",)), ("norm", ("fsdp",)),
            ("lm_head", ("fsdp", None)))
GLOBAL_BATCH, SEQ = 8, 8192


def _attention_function(kind: str, mesh, spec):
    """Hugging Face's attention interface, calling torch_xla's kernel as torchprime's
    ``AttentionModule`` does: queries scaled first, keys and values repeated to every head
    for flash (splash takes grouped heads)."""
    from transformers.models.llama.modeling_llama import repeat_kv
    if kind == "flash":
        from torch_xla.experimental.custom_kernel import FlashAttention, flash_attention
        FlashAttention.DEFAULT_BLOCK_SIZES = dict(FLASH_BLOCKS)

        def attend(module, q, k, v, mask, scaling, dropout=0.0, **kwargs):
            k = repeat_kv(k, module.num_key_value_groups)
            v = repeat_kv(v, module.num_key_value_groups)
            out = flash_attention(q * scaling, k, v, causal=True, partition_spec=spec,
                                  mesh=mesh)
            return out.transpose(1, 2).contiguous(), None
        return attend
    from torch_xla.experimental.splash_attention import SplashAttentionConfig, splash_attention
    config = SplashAttentionConfig(mesh=str(mesh), qkv_partition_spec=spec,
                                   segment_ids_partition_spec=(spec[0], None)).to_json()

    def attend(module, q, k, v, mask, scaling, dropout=0.0, **kwargs):
        return splash_attention(q * scaling, k, v, config).transpose(1, 2).contiguous(), None
    return attend


def _llama(attention: str, rope_scaling: Optional[dict], dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**LLAMA_8B, rope_scaling=rope_scaling, use_cache=False)
    config._attn_implementation = attention
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


def torchprime_step(rank: int, kind: str, steps: int = 3) -> None:
    """torchprime's e2e training step (see the module docstring), traced as SPMD."""
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import checkpoint_module
    from transformers import AttentionInterface
    from transformers.optimization import Adafactor

    from scripts.bench.tpu_plan import _on_device
    xr.use_spmd()
    chips = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(chips), (1, chips, 1, 1), ("data", "fsdp", "tensor", "expert"))
    xs.set_global_mesh(mesh)
    spec = (("data", "fsdp"), "tensor", None, None)
    AttentionInterface.register(f"torchprime_{kind}", _attention_function(kind, mesh, spec))
    model = _llama(f"torchprime_{kind}", LLAMA_31_ROPE if kind == "splash" else None,
                   torch.bfloat16)
    device = torch_xla.device()
    _on_device(model, device)
    for name, p in model.named_parameters():
        xs.mark_sharding(p, mesh, next(s for key, s in SHARDING if key in name))

    def batch_sharded(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        xs.mark_sharding(hidden, mesh, (("data", "fsdp"), None, None))
    for i, layer in enumerate(model.model.layers):
        layer = checkpoint_module(layer)
        xs.apply_backward_optimization_barrier(layer)
        layer.register_forward_hook(batch_sharded)
        model.model.layers[i] = layer
    optimizer = Adafactor(model.parameters(), lr=5e-5, relative_step=False,
                          scale_parameter=False)
    for _ in range(steps):
        ids = torch.randint(0, LLAMA_8B["vocab_size"], (GLOBAL_BATCH, SEQ)).to(device)
        xs.mark_sharding(ids, mesh, (("data", "fsdp"), None))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()


def ours_step(rank: int, steps: int = 3, vocab_parallel: bool = False) -> None:
    """torchprime's model and batch with ``xla_fsdp`` (see the module docstring), with its
    vocabulary tables in row blocks if ``vocab_parallel``."""
    import functools

    import torch
    import torch_xla
    import torch_xla.runtime as xr
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.optimization import Adafactor

    from xla_fsdp import FSDP, allow_per_shard_statistics, checkpoint_module
    from xla_fsdp.wrap import transformer_auto_wrap_policy
    AttentionInterface.register("ours_flash", _attention_function("flash", None, None))
    model = _llama("ours_flash", None, torch.float32)
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, compute_dtype=torch.bfloat16,
                 auto_wrapper_callable=lambda m, *a, **k: FSDP(checkpoint_module(m), *a, **k),
                 vocab_parallel=vocab_parallel)
    # Adafactor's statistics over each rank's slice: not the unsharded update, but the
    # optimizer torchprime's step runs (see [Note: optimizers that read the whole tensor])
    optimizer = allow_per_shard_statistics(Adafactor(model.parameters(), lr=5e-5,
                                                     relative_step=False,
                                                     scale_parameter=False))
    per_chip = GLOBAL_BATCH // xr.world_size()
    for _ in range(steps):
        ids = torch.randint(0, LLAMA_8B["vocab_size"], (per_chip, SEQ)).to(torch_xla.device())
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()


def plan_row(row: str, libtpu_flags: str) -> dict:
    """Traces and compiles a row's step; returns its report's figures and its optimized
    HLO (``hlo``), for the fit."""
    from xla_fsdp.aot.plan import report_for, trace_step
    from xla_fsdp.aot.topology import resolve
    os.environ["LIBTPU_INIT_ARGS"] = libtpu_flags
    slice_ = resolve("v6e-4")
    started = time.monotonic()
    if row == "ours":
        traced = trace_step(ours_step, (), slice_.chips)
    else:
        traced = trace_step(torchprime_step, (row.split("-")[1],), slice_.chips)
    report = report_for(traced, slice_)
    return {"row": row, "topology": slice_.cloud_name, "fits": report.fits,
            "peak_gib": report.peak_bytes / 2 ** 30,
            "required_gib": report.required_bytes / 2 ** 30,
            "model_flops": report.model_flops, "compiler_flops": report.flops,
            "optimized_hlo": report.optimized_hlo, "coords": report.coords,
            "seconds": time.monotonic() - started, "message": report.message}


def _cached_row(row: str, ns: argparse.Namespace) -> Tuple[dict, List[str]]:
    """A row's figures and optimized programs, compiled now or read from ``--cache`` (an
    8B step takes libtpu ten minutes and more to compile on two cores)."""
    folder = os.path.join(ns.cache, row)
    figures = os.path.join(folder, "figures.json")
    if os.path.exists(figures) and not ns.recompile:
        with open(figures) as f:
            result = json.load(f)
        hlos = []
        for i in range(result["programs"]):
            with open(os.path.join(folder, f"program_{i}.hlo.txt")) as f:
                hlos.append(f.read())
        return result, hlos
    result = plan_row(row, ns.libtpu_flags)
    hlos = result.pop("optimized_hlo")
    result["programs"] = len(hlos)
    os.makedirs(folder, exist_ok=True)
    for i, text in enumerate(hlos):
        with open(os.path.join(folder, f"program_{i}.hlo.txt"), "w") as f:
            f.write(text)
    with open(figures, "w") as f:
        json.dump(result, f, indent=1)
    return result, hlos


def fit(schedules: Dict[str, list], measured: Dict[str, float]):
    """The efficiencies that minimize the largest |log(estimate / measured)| over the
    measured rows: the matmul fraction to 0.01 for each memory fraction of 0.6 to 1.0 (the
    error is unimodal in it: a ternary search), ICI at the scaling book's rate; and each
    row's estimate under them."""
    from xla_fsdp.aot.step_time import Efficiency

    def estimates(e):
        return {row: sum(s.estimate(e).seconds for s in parts)
                for row, parts in schedules.items()}

    def worst(e):
        got = estimates(e)
        return max(abs(math.log(got[r] / measured[r])) for r in measured)
    best: Tuple[float, Optional[Efficiency]] = (math.inf, None)
    for memory in (0.6, 0.7, 0.8, 0.9, 1.0):
        low, high = 20, 100
        while high - low > 2:
            a, b = low + (high - low) // 3, high - (high - low) // 3
            if worst(Efficiency(a / 100, memory)) <= worst(Efficiency(b / 100, memory)):
                high = b
            else:
                low = a
        for m in range(low, high + 1):
            e = Efficiency(m / 100, memory)
            error = worst(e)
            if error < best[0]:
                best = (error, e)
    return best[1], estimates(best[1])


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--maxtext-hlo", default=os.path.join(OUT, "compiled", "maxtext.hlo.txt"),
                        help="MaxText's compiled step, as `python -m "
                             "scripts.bench.maxtext_compile` writes it (its default path)")
    parser.add_argument("--libtpu-flags", default=TORCHPRIME_LIBTPU)
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--cache", default=os.path.join(OUT, "compiled"),
                        help="where each row's compiled programs are kept (not committed)")
    parser.add_argument("--recompile", action="store_true",
                        help="compile every row again instead of reading --cache")
    ns = parser.parse_args(argv)
    from xla_fsdp.aot.step_time import Efficiency, Schedule
    from xla_fsdp.aot.topology import resolve
    os.makedirs(ns.out, exist_ok=True)
    rows: Dict[str, dict] = {}
    schedules: Dict[str, list] = {}
    for row in ns.rows:
        if row == "maxtext":
            if not os.path.exists(ns.maxtext_hlo):
                print(f"maxtext: skipped ({ns.maxtext_hlo} does not exist: run `python -m "
                      f"scripts.bench.maxtext_compile` first)", file=sys.stderr)
                continue
            with open(ns.maxtext_hlo) as f:
                text = f.read()
            rows[row] = {"row": row, "topology": "v6e-8", "fits": True,
                         "hlo_file": ns.maxtext_hlo}
            schedules[row] = [Schedule(text, resolve("v6e-8"))]
            continue
        result, hlos = _cached_row(row, ns)
        rows[row] = result
        print(json.dumps(result), flush=True)
        if result["fits"]:
            schedules[row] = [Schedule(h, resolve(result["topology"]), result["coords"])
                              for h in hlos]
    peak = {row: sum(s.estimate(Efficiency()).seconds for s in parts)
            for row, parts in schedules.items()}
    measured = {r: MEASURED[r].seconds for r in schedules if r in MEASURED}
    efficiency, fitted = fit(schedules, measured) if measured else (Efficiency(), peak)
    # each measured row predicted by a fit on the others: what the fit says of a run it
    # has not seen
    held_out = {}
    for row in measured if len(measured) > 2 else ():
        others = {r: m for r, m in measured.items() if r != row}
        _, predicted = fit({r: schedules[r] for r in list(others) + [row]}, others)
        held_out[row] = predicted[row]
    command = "python -m scripts.bench.tpu_calibration " + shlex.join(argv)
    lines = ["# The step-time model against measured TPU runs", "",
             f"`{command}` (libtpu 0.0.50.1; LIBTPU_INIT_ARGS for the torchprime rows: "
             f"`{ns.libtpu_flags}`)", "",
             f"Fitted: {efficiency.matmul:.2f} of the bf16 matmul peak, "
             f"{efficiency.memory:.2f} of HBM bandwidth, ICI at the scaling book's per-link "
             f"rate.", "",
             "| row | slice | measured s | estimate at the peaks s | estimate, fitted s | "
             "error | fitted on the other rows: error | source |",
             "|---|---|---|---|---|---|---|---|"]
    for row in schedules:
        m = MEASURED.get(row)
        error = f"{100 * (fitted[row] / m.seconds - 1):+.1f}%" if m else "-"
        unseen = f"{100 * (held_out[row] / m.seconds - 1):+.1f}%" if row in held_out else "-"
        lines.append(f"| {row} | {rows[row]['topology']} | "
                     f"{m.seconds if m else '-'} | {peak[row]:.3f} | {fitted[row]:.3f} | "
                     f"{error} | {unseen} | {m.source if m else 'not measured'} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(ns.out, "calibration.md"), "w") as f:
        f.write(text)
    with open(os.path.join(ns.out, "calibration.json"), "w") as f:
        json.dump({"rows": rows, "peak": peak, "fitted": fitted, "held_out": held_out,
                   "efficiency": {"matmul": efficiency.matmul, "memory": efficiency.memory},
                   "command": command}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
