"""Where our step's extra HBM traffic on TPU comes from: the benchmark's GPT (D=512, 4
blocks, AdamW, 128 tokens per chip) planned for a v5e-4 (``xla_fsdp.aot``) with one setting
changed at a time, next to FSDPv2's. The compiler's figures, not measurements.

    python -m scripts.bench.tpu_levers            # -> benchmarks/results/tpu_plan/levers.md

Settings: ``shard_param_on_dim_0`` (shards keep their rows, so a gathered weight needs no
relayout from a flat 1-D buffer into the TPU's tiled 2-D layout), unpinned collectives
(``pin_layout_in_collective_ops=False``), torch_xla's collective token off
(``DISABLE_NUMERIC_CC_TOKEN=1``: no ``input + token`` pass over each collective's input and
no chain from one collective to the next), and optimization barriers off.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from typing import Dict, List, Optional

OUT = os.path.join("benchmarks", "results", "tpu_plan", "levers.md")
# flat shards, one gather per piece: torch_xla's defaults, and ours off a TPU
FLAT = {"shard_param_on_dim_0": False, "coalesce_all_gather_ops": False}
DIM0 = dict(FLAT, shard_param_on_dim_0=True)
VARIANTS = [
    ("xla_fsdp, flat shards", "xla_fsdp", FLAT, {}),
    ("+ shard_param_on_dim_0", "xla_fsdp", DIM0, {}),
    ("+ unpinned", "xla_fsdp", dict(DIM0, pin_layout_in_collective_ops=False), {}),
    ("+ token off", "xla_fsdp", dict(DIM0, pin_layout_in_collective_ops=False),
     {"DISABLE_NUMERIC_CC_TOKEN": "1"}),
    ("+ barriers off", "xla_fsdp", dict(DIM0, pin_layout_in_collective_ops=False,
                                        optimization_barrier_in_forward=False,
                                        optimization_barrier_in_backward=False),
     {"DISABLE_NUMERIC_CC_TOKEN": "1"}),
    ("xla_fsdp, defaults (a TPU's)", "xla_fsdp", {}, {}),
    ("FSDPv2", "fsdpv2", {}, {}),
]


def train_step(rank: int, impl: str, options: Dict, environment: Dict[str, str]) -> None:
    os.environ.update(environment)   # before torch_xla lowers its first collective
    import torch
    import torch_xla

    from .model import Block, Config, batch, build_model
    cfg = Config(layers=4, dim=512, heads=8, vocab=8192, seq=128, batch=1)
    model = build_model(cfg)
    device = torch_xla.device()
    chips, mesh = 1, None
    if impl == "fsdpv2":
        import numpy as np
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
            SpmdFullyShardedDataParallel as FSDPv2)
        xr.use_spmd()
        chips = xr.global_runtime_device_count()
        mesh = xs.Mesh(np.arange(chips), (chips, 1), ("fsdp", "model"))
        model = FSDPv2(model.to(device), mesh=mesh, auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    else:
        from xla_fsdp import FSDP
        from xla_fsdp.wrap import transformer_auto_wrap_policy
        model = FSDP(model, auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}), **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    for step in range(4):
        parts = [batch(cfg, r, step) for r in range(chips)]   # SPMD: the global batch
        tokens, targets = (torch.cat(t).to(device) for t in zip(*parts))
        if mesh is not None:
            import torch_xla.distributed.spmd as xs
            xs.mark_sharding(tokens, mesh, ("fsdp", None))
            xs.mark_sharding(targets, mesh, ("fsdp", None))
        model(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()


def main(argv: Optional[List[str]] = None) -> None:
    from .report import publish
    from xla_fsdp.aot import compile_for_tpu
    lines = ["# Our step's HBM traffic on TPU, one setting at a time", "",
             "`python -m scripts.bench.tpu_levers`: the benchmark's GPT (D=512, 4 blocks, "
             "AdamW, 128 tokens per chip), planned for a v5e-4 by libtpu; from flat shards, "
             "each row adds one setting to the row above; then our defaults on a TPU. The "
             "compiler's figures, not measurements.", "",
             "| setting | peak MiB | HBM accessed MiB | x FSDPv2's | collectives | "
             "overlapped |", "|---|---|---|---|---|---|"]
    rows = []
    for name, impl, options, environment in VARIANTS:
        report = compile_for_tpu(train_step, "v5e-4", args=(impl, options, environment))
        summary = report.collective_summary()
        rows.append((name, report.peak_bytes / 2 ** 20, report.bytes_accessed / 2 ** 20,
                     sum(int(v["count"]) for v in summary.values()),
                     sum(int(v["overlapped"]) for v in summary.values())))
        print(json.dumps(rows[-1]), flush=True)
    reference = rows[-1][2]
    for name, peak, accessed, count, overlapped in rows:
        lines.append(f"| {name} | {peak:.1f} | {accessed:.0f} | {accessed / reference:.2f} | "
                     f"{count} | {overlapped} |")
    publish(lines, OUT)


if __name__ == "__main__":
    main(sys.argv[1:])
