"""The same model, batch and TPU slice compiled by libtpu for ours, torch_xla's FSDP and SPMD
FSDPv2, side by side (``xla_fsdp.aot``): peak HBM, FLOPs, HBM bytes accessed and collective
bytes per chip, how many collectives the TPU schedule overlaps with compute, the step-time
estimate (``xla_fsdp.aot.step_time``) and MFU, and the deepest Llama-3.1-8B-shaped model
each fits on a v5e-8 for AdamW full fine-tuning. Every figure is the compiler's, not a measurement.

    python -m scripts.bench.tpu_plan                       # the table (4 settings x 3)
    python -m scripts.bench.tpu_plan --deepest v5e-8       # + the depth search
    python -m scripts.bench.tpu_plan --shapes llama-3.2-1b --topologies v5e-8 --seq 512

The model is Hugging Face's ``LlamaForCausalLM`` built on the meta device from each shape's
configuration (float32, no activation checkpointing), one unit per decoder layer
(``transformer_auto_wrap_policy``) for all three, AdamW, ``--seq`` tokens per chip. Nothing
is executed and no weight is held: the plans trace in a few GiB whatever the model's size.
Results go to ``benchmarks/results/tpu_plan/``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

IMPLS = ("xla_fsdp", "xla_fsdp_vocab", "xla_fsdp_unpinned", "torch_xla", "fsdpv2")
# "xla_fsdp" at its defaults, a TPU's (row-block shards, one unpinned gather per unit), and
# with vocab_parallel=True (docs/wrapper.md); the unpinned variant has the options torch_xla's FSDP runs with here (its pinned all-gather is
# an all-reduce of N times the data). Not run by default: "xla_fsdp_flat", the defaults off
# a TPU (torch_xla's flat shards, a TPU's too before issue 52), and "xla_fsdp_tpu", issue
# 38's recommended settings (TPU_SETTINGS).
FLAT = {"shard_param_on_dim_0": False, "coalesce_all_gather_ops": False}
TPU_SETTINGS = {"pin_layout_in_collective_ops": False, "shard_param_on_dim_0": True}
TPU_ENVIRONMENT = {"DISABLE_NUMERIC_CC_TOKEN": "1"}   # read by torch_xla when first lowering
SHAPES: Dict[str, dict] = {
    # https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, head_dim=64),
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=False, rope_theta=500000.0, head_dim=128),
}
# an ablation: the 1B shape with a small vocabulary, to see what the vocabulary costs each
SHAPES["llama-3.2-1b-vocab8k"] = dict(SHAPES["llama-3.2-1b"], vocab_size=8192)
OUT = os.path.join("benchmarks", "results", "tpu_plan")


@dataclass(frozen=True)
class Setting:
    impl: str
    shape: str
    layers: int
    seq: int            # tokens per chip (one sequence)
    steps: int = 4
    options: tuple = ()  # (name, value) pairs of extra wrapper options (ours, torch_xla's)
    act_ckpt: bool = False   # each implementation's checkpoint_module around each layer
    autocast: bool = False   # the forward under torch.autocast("xla", dtype=bfloat16)
    attention: str = ""      # Hugging Face's attn_implementation ("": its default, sdpa)


def _config(setting: Setting):
    from transformers import LlamaConfig
    values = dict(SHAPES[setting.shape], num_hidden_layers=setting.layers, use_cache=False,
                  max_position_embeddings=max(8192, setting.seq))
    return LlamaConfig(**values)


def _on_device(module, device) -> None:
    """Meta parameters and buffers of ``module`` (not of wrapped children) as uninitialised
    tensors on ``device``, traced lazily: torch_xla's ``param_init_fn`` for a meta model,
    and FSDPv2's model. ``torch.empty``, not ``to_empty``: torch_xla makes ``empty_like``
    a strided view of a hidden tensor, which its every update then rewrites too."""
    import torch
    import torch.nn as nn
    done = {}
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if p.is_meta:
                if p not in done:
                    done[p] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                           requires_grad=p.requires_grad)
                setattr(sub, name, done[p])
        for name, b in list(sub.named_buffers(recurse=False)):
            if b.is_meta:
                sub.register_buffer(name, torch.empty(b.shape, dtype=b.dtype, device=device))


def _shard_output(output, mesh) -> None:
    """FSDPv2's output sharding for Hugging Face outputs (its default takes a tensor or a
    tuple only): the logits, or the hidden states, along the batch, as its docs do."""
    import torch_xla.distributed.spmd as xs
    real = getattr(output, "logits", None)
    if real is None:
        real = output[0] if isinstance(output, (tuple, list)) else output
    xs.mark_sharding(real, mesh, ("fsdp",) + (None,) * (real.dim() - 1))


def train_step(rank: int, setting: Setting) -> None:
    """The training function every plan compiles: build, wrap, AdamW, ``steps`` steps."""
    import contextlib

    import torch
    import torch_xla
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = _config(setting)
    if setting.attention:
        config._attn_implementation = setting.attention
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    layer = {LlamaDecoderLayer}
    device = torch_xla.device()
    mesh = None

    def wrapping(wrapper_cls, checkpoint_module) -> dict:
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer)
        if not setting.act_ckpt:
            return {"auto_wrap_policy": policy}
        return {"auto_wrap_policy": policy, "auto_wrapper_callable":
                lambda m, *a, **k: wrapper_cls(checkpoint_module(m), *a, **k)}

    if setting.impl.startswith("xla_fsdp"):
        from xla_fsdp import FSDP, checkpoint_module
        from xla_fsdp.wrap import transformer_auto_wrap_policy
        options = dict(setting.options)
        if setting.impl == "xla_fsdp_vocab":   # the defaults and vocabulary-parallel tables
            options["vocab_parallel"] = True
        if setting.impl == "xla_fsdp_unpinned":
            options["pin_layout_in_collective_ops"] = False
        if setting.impl == "xla_fsdp_flat":
            options.update(FLAT)
        if setting.impl == "xla_fsdp_tpu":
            options.update(TPU_SETTINGS)
            os.environ.update(TPU_ENVIRONMENT)
        model = FSDP(model, **wrapping(FSDP, checkpoint_module), **options)
    elif setting.impl == "torch_xla":
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
        from torch_xla.distributed.fsdp import checkpoint_module
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        model = FSDP(model, **wrapping(FSDP, checkpoint_module),
                     param_init_fn=functools.partial(_on_device, device=device),
                     **dict((("pin_layout_in_collective_ops", False),) + setting.options))
    else:
        import numpy as np
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        from torch_xla.distributed.fsdp import checkpoint_module
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
            SpmdFullyShardedDataParallel as FSDPv2)
        xr.use_spmd()
        n = xr.global_runtime_device_count()
        mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
        xs.set_global_mesh(mesh)
        _on_device(model, device)
        # torch_xla's SPMD docs: auto_wrapper_callable wraps the checkpointed layer
        model = FSDPv2(model, mesh=mesh, shard_output=_shard_output,
                       **wrapping(FSDPv2, checkpoint_module))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    chips = mesh.size() if mesh is not None else 1
    for step in range(setting.steps):
        ids = torch.randint(0, config.vocab_size, (chips, setting.seq)).to(device)
        if mesh is not None:
            import torch_xla.distributed.spmd as xs
            xs.mark_sharding(ids, mesh, ("fsdp", None))
        context = (torch.autocast("xla", dtype=torch.bfloat16) if setting.autocast
                   else contextlib.nullcontext())
        with context:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()


def plan(setting: Setting, topology: str) -> dict:
    from xla_fsdp.aot import compile_for_tpu
    started = time.monotonic()
    report = compile_for_tpu(train_step, topology, args=(setting,))
    summary = report.collective_summary()
    row = {"impl": setting.impl, "shape": setting.shape, "layers": setting.layers,
           "seq": setting.seq, "topology": report.topology.cloud_name, "fits": report.fits,
           "peak_gib": report.peak_bytes / 2 ** 30,
           "required_gib": report.required_bytes / 2 ** 30,
           "usable_gib": report.usable_hbm_bytes / 2 ** 30,
           "tflops_per_chip": report.flops / 1e12,
           "hbm_accessed_gib": report.bytes_accessed / 2 ** 30,
           "collective_gib": report.collective_bytes / 2 ** 30,
           "collectives": sum(int(v["count"]) for v in summary.values()),
           "overlapped": sum(int(v["overlapped"]) for v in summary.values()),
           "by_kind": summary,
           "estimate_ms": report.step_seconds * 1e3 if report.step_seconds else None,
           "mfu": report.mfu, "hfu": report.hfu, "notes": report.notes,
           "seconds": time.monotonic() - started}
    print(json.dumps({k: v for k, v in row.items() if k != "by_kind"}), flush=True)
    return row


def deepest(impl: str, topology: str, seq: int, most: int) -> dict:
    """The most Llama-3.1-8B-shaped layers that fit (fitting is monotone in depth, so the
    one-layer-at-a-time answer is found by bisection)."""
    fits: Dict[int, bool] = {}

    def check(layers: int) -> bool:
        if layers not in fits:
            fits[layers] = plan(Setting(impl, "llama-3.1-8b", layers, seq), topology)["fits"]
        return fits[layers]

    low, high = 0, None          # low fits (0: nothing), high does not
    probe = 1
    while high is None and probe <= most:
        if check(probe):
            low, probe = probe, probe * 2
        else:
            high = probe
    high = high if high is not None else most + 1
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if check(mid) else (low, mid)
    return {"impl": impl, "topology": topology, "seq": seq, "deepest": low,
            "probed": dict(sorted(fits.items()))}


def _markdown(rows: List[dict], depths: List[dict], command: str) -> str:
    lines = ["# Planned on the TPU compiler: ours, torch_xla's FSDP and FSDPv2", "",
             f"`{command}` (libtpu's figures per chip, not measurements; float32, AdamW, "
             f"no activation checkpointing, one unit per decoder layer)", "",
             "| model | slice | impl | fits | peak GiB | TFLOP/chip | HBM accessed GiB | "
             "collective GiB | overlapped / collectives | estimate ms | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = f"{r['peak_gib']:.2f}" if r["fits"] else f"needs {r['required_gib']:.2f}"
        est = f"{r['estimate_ms']:.1f}" if r["estimate_ms"] is not None else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        lines.append(f"| {r['shape']} ({r['layers']} layers, {r['seq']} tok/chip) | "
                     f"{r['topology']} | {r['impl']} | {'yes' if r['fits'] else 'no'} | {peak} | "
                     f"{r['tflops_per_chip']:.2f} | {r['hbm_accessed_gib']:.1f} | "
                     f"{r['collective_gib']:.2f} | {r['overlapped']} / {r['collectives']} | "
                     f"{est} | {mfu} |")
    if depths:
        lines += ["", "Deepest Llama-3.1-8B-shaped model that fits (layers):", "",
                  "| impl | slice | tokens/chip | layers | probed (layers: fits) |",
                  "|---|---|---|---|---|"]
        for d in depths:
            lines.append(f"| {d['impl']} | {d['topology']} | {d['seq']} | {d['deepest']} | "
                         f"{d['probed']} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=["llama-3.2-1b", "llama-3.1-8b"],
                        help=f"of {list(SHAPES)}")
    parser.add_argument("--topologies", nargs="+", default=["v5e-8", "v6e-8"])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS),
                        help=f"of {IMPLS + ('xla_fsdp_flat', 'xla_fsdp_tpu')}")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per chip")
    parser.add_argument("--layers", type=int, help="override every shape's depth")
    parser.add_argument("--deepest", help="also search the deepest 8B-shaped model here")
    parser.add_argument("--libtpu-flags", help="LIBTPU_INIT_ARGS for the compiler, e.g. "
                        "MaxText's async-collective flags")
    parser.add_argument("--out", default=OUT)
    ns = parser.parse_args(argv)
    if ns.libtpu_flags:
        os.environ["LIBTPU_INIT_ARGS"] = ns.libtpu_flags
    command = "python -m scripts.bench.tpu_plan " + shlex.join(argv)
    rows = [plan(Setting(impl, shape, ns.layers or SHAPES[shape]["num_hidden_layers"],
                         ns.seq), topology)
            for shape in ns.shapes for topology in ns.topologies for impl in ns.impls]
    depths = [deepest(impl, ns.deepest, ns.seq, 64) for impl in ns.impls] if ns.deepest \
        else []
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "tpu_plan.json"), "w") as f:
        json.dump({"rows": rows, "deepest": depths, "command": command}, f, indent=1)
    text = _markdown(rows, depths, command)
    with open(os.path.join(ns.out, "tpu_plan.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
