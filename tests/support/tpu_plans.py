"""Training functions the TPU-planning tests compile, and the same steps executed for real
on virtual devices with XLA's dumps, to compare the planned programs with torch_xla's own.

Every function takes ``(rank, build, dump_dir, steps)``: ``build`` "real" builds the model
on the CPU, "meta" on the meta device (ours: sharded as placeholders when planned; FSDPv2:
its parameters created on the device), and with ``dump_dir`` rank 0 returns the HLO
modules XLA compiled during the second step, the steady one.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import List, Optional

import torch
import torch.nn as nn

from examples.train_lm import Block

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 1024, 256, 4, 3, 64, 2   # per rank


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())


def _build(build: str) -> GPT:
    torch.manual_seed(0)
    if build == "meta":
        with torch.device("meta"):
            return GPT()
    return GPT()


def _steady_dumps(dump_dir: str, before: List[str]) -> List[str]:
    new = sorted(set(os.listdir(dump_dir)) - set(before))
    out = []
    for name in new:
        if name.endswith(".before_optimizations.txt"):
            with open(os.path.join(dump_dir, name)) as f:
                out.append(f.read())
    return out


def _loop(model, batches, dump_dir: Optional[str], steps: int, rank: int):
    import torch_xla
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steady = None
    for step in range(steps):
        before = os.listdir(dump_dir) if dump_dir and rank == 0 and step == 1 else None
        loss = model(batches(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        if before is not None:
            steady = _steady_dumps(dump_dir, before)
    return steady


def ours(rank: int, build: str = "real", dump_dir: Optional[str] = None, steps: int = 4,
         hardware: Optional[str] = None, **fsdp_kwargs):
    """``hardware``: build the units with that hardware's defaults, as a plan for it does
    (every rank sets the same, process-wide)."""
    import torch_xla
    from xla_fsdp import FSDP
    if hardware is not None:
        from xla_fsdp._xla.hardware import plan_for
        plan_for(hardware)
    from xla_fsdp.wrap import transformer_auto_wrap_policy
    model = FSDP(_build(build), auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}), **fsdp_kwargs)
    device = torch_xla.device()

    def batches(step):
        g = torch.Generator().manual_seed(1000 * rank + step)
        return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
    return _loop(model, batches, dump_dir, steps, rank)


def fsdpv2(rank: int, build: str = "real", dump_dir: Optional[str] = None, steps: int = 4):
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel as FSDPv2)
    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    device = torch_xla.device()
    model = _build(build)
    if build == "meta":   # parameters made on the device: sharded by annotating their graphs
        for m in model.modules():
            for name, p in list(m.named_parameters(recurse=False)):
                setattr(m, name, nn.Parameter(torch.empty(p.shape, device=device)))
    model = FSDPv2(model.to(device), mesh=mesh, auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}))

    def batches(step):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, VOCAB, (BATCH * n, SEQ), generator=g).to(device)
        xs.mark_sharding(tokens, mesh, ("fsdp", None))
        return tokens
    return _loop(model, batches, dump_dir, steps, rank)


def syncs_twice(rank: int):
    """A loop that syncs after forward too: a step is two programs."""
    import torch_xla
    from xla_fsdp import FSDP
    model = FSDP(nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = model(torch.ones(4, 64).to(torch_xla.device())).sum()
        torch_xla.sync()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()


def scaled(rank: int):
    """GradScaler over FSDP shards: the step is cut before it reads its flags, so it is two
    programs (see [Note: a host read runs the graph behind it again])."""
    import torch_xla
    from xla_fsdp import FSDP
    model = FSDP(nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("xla")
    for _ in range(5):
        scaler.scale(model(torch.ones(4, 64).to(torch_xla.device())).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        torch_xla.sync()


def reads_and_saves(rank: int, path: str, how: str = "torch.save"):
    """Reads values on the host (zeros in a plan), then saves a checkpoint (refused)."""
    import torch_xla
    from xla_fsdp import FSDP
    model = FSDP(nn.Linear(64, 64))
    loss = model(torch.ones(4, 64).to(torch_xla.device())).sum()
    loss.backward()
    torch_xla.sync()
    if loss.item() != 0.0 or next(model.parameters()).sum().cpu().item() != 0.0:
        raise AssertionError("values read in a plan are not zeros")
    if how == "torch.save":
        torch.save({"loss": loss}, path)
    else:
        from xla_fsdp.checkpoint import save_sharded
        save_sharded(path, model)


_EXECUTE_SPMD = """
import json, sys
sys.path[:0] = {paths!r}
from tests.support import tpu_plans
print(json.dumps(tpu_plans.fsdpv2(0, {build!r}, {dump_dir!r}, 3)))
"""


def executed_steady_step(workload: str, build: str, dump_dir: str, world: int) -> List[str]:
    """The HLO modules XLA compiled for the steady step of ``workload`` run for real on
    ``world`` virtual devices (launch for ours; one SPMD process for FSDPv2)."""
    import json
    # the dump is the module before XLA's passes, so the suite's quick code generation
    # (tests/conftest.py) leaves it as it is and the step compiles in seconds
    dump = f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
    env = dict(os.environ, XLA_FLAGS=" ".join(f for f in (os.environ.get("XLA_FLAGS"), dump) if f))
    if workload == "fsdpv2":
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(world))
        code = _EXECUTE_SPMD.format(paths=sys.path[:3] + [os.getcwd()], build=build,
                                    dump_dir=dump_dir)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    from xla_fsdp import launch
    from xla_fsdp.launch.environment import restored_environment
    with restored_environment(["XLA_FLAGS"]):
        os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]
        return launch(ours, (build, dump_dir, 3, "TPU"), num_devices=world)[0]


def does_nothing(rank: int):
    """Traces nothing."""


def never_syncs(rank: int):
    """Traces a step but never ends it with a sync."""
    import torch_xla
    from xla_fsdp import FSDP
    model = FSDP(nn.Linear(64, 64))
    model(torch.ones(4, 64).to(torch_xla.device())).sum().backward()


class _Wide(nn.Module):
    """A stack of wide layers: its weights and AdamW's state (16 bytes a parameter) are
    what a chip must hold, not its activations."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.pow(2).mean()


WIDE = (12288, 8)       # 1.2e9 parameters: 19.3 GB with AdamW, more than a v5e chip's 16 GiB


def too_big_for_one_chip(rank: int, offload: bool = False, steps: int = 4):
    """A meta model one v5e chip cannot train with AdamW unless its optimizer leaves the
    chip (``offload_optimizer``) or more chips share it."""
    import torch_xla
    from xla_fsdp import FSDP
    from xla_fsdp.wrap import transformer_auto_wrap_policy
    with torch.device("meta"):
        model = _Wide(*WIDE)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})
    model = FSDP(model, auto_wrap_policy=policy, offload_optimizer=offload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        model(torch.ones(8, WIDE[0]).to(torch_xla.device())).backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()


class _FlashBlock(nn.Module):
    """Causal self-attention through torch_xla's Pallas flash attention kernel."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch_xla.experimental.custom_kernel import flash_attention
        return flash_attention(q, k, v, causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return x + self.out(self.attend(q, k, v).transpose(1, 2).reshape(b, s, d))


class _SdpaBlock(_FlashBlock):
    """Causal self-attention through torch's ``scaled_dot_product_attention``."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


FLASH = dict(dim=512, heads=4, seq=1024, batch=2, layers=2)
SDPA = dict(dim=256, heads=4, seq=2048, batch=1)


def _attention_units(block: type, sizes: dict, layers: int, steps: int,
                     compute_dtype: torch.dtype = torch.float32) -> None:
    """``layers`` units of ``block`` in ``compute_dtype``, trained with AdamW."""
    import torch_xla
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(*(FSDP(block(sizes["dim"], sizes["heads"]),
                                      compute_dtype=compute_dtype) for _ in range(layers))),
                 compute_dtype=compute_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shape = (sizes["batch"], sizes["seq"], sizes["dim"])
    for _ in range(steps):
        model(torch.randn(shape).to(torch_xla.device())).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()


def with_flash_attention(rank: int, steps: int = 4):
    """Two units of flash attention, trained with AdamW."""
    _attention_units(_FlashBlock, FLASH, FLASH["layers"], steps)


def with_sdpa(rank: int, layers: int, compute_dtype: torch.dtype = torch.float32,
              steps: int = 4):
    """``layers`` units of sdpa attention in ``compute_dtype``, trained with AdamW."""
    _attention_units(_SdpaBlock, SDPA, layers, steps, compute_dtype)
