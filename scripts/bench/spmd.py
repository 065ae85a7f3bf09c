"""torch_xla's SPMD FSDPv2 (``SpmdFullyShardedDataParallel``) as a competitor of the benchmark.

SPMD runs in ONE process that holds all N virtual XLA:CPU devices (``PJRT_DEVICE=CPU
CPU_NUM_DEVICES=N``, then ``xr.use_spmd()``). The process traces the step once, for the
global batch; XLA partitions the program into one per-device program and runs it on the N
devices. The model, its initial weights, the global batch (rank r's batch of
``scripts.bench.model.batch`` is row block r), AdamW and the training loop
(``scripts.bench.train.train``) are those of the other competitors.

Variants:

- ``fsdpv2``: as torch_xla's FSDPv2 docs and ``examples/fsdp/train_decoder_only_fsdp_v2.py``
  do it: a mesh ``(N, 1)`` over ``('fsdp', 'model')`` set as the global mesh, every block
  wrapped (``transformer_auto_wrap_policy``), then the root; inputs sharded along the batch
  with ``xs.mark_sharding(x, mesh, ('fsdp', None))``.
- ``spmd_unwrapped``: no wrapper, the baseline of the host-time split: parameters
  replicated, the global batch sharded along the batch as above (XLA partitions it as data
  parallelism);
- ``fsdpv2_scan``: the same, with the model's forward running
  ``torch_xla.experimental.scan_layers`` over the blocks. Each block is wrapped by FSDPv2
  as above (the same parameter sharding), but with ``shard_output`` turned off, because
  FSDPv2's own one (an in-place ``mark_sharding`` on the block's output) fails inside the
  AOTAutograd trace that scan_layers makes of the layer ("Expected XLA tensor. Got:
  XLAFloatType"). The block's output is sharded along the batch instead with
  ``mark_sharding_with_gradients``, which is traceable, by a thin module around each wrapped
  block. Under SPMD, scan's backward calls ``shard_as``, which needs JAX and torchax
  (torch_xla's ``pallas`` extra: ``pip install jax==0.7.1 jaxlib==0.7.1 torchax``).
"""
from __future__ import annotations

import functools
import multiprocessing
import pickle
import traceback
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from xla_fsdp.launch import LaunchError
from xla_fsdp.launch.environment import environment_for_child
from xla_fsdp.launch.virtual.worker import environment

from .model import GPT, Block, Config, batch, build_model
from .train import train


# -- the process --------------------------------------------------------------------------
def _child(conn, fn, args) -> None:
    try:
        result = ("ok", fn(*args))
    except BaseException as exc:  # noqa: BLE001  (reported to the parent)
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        conn.send_bytes(pickle.dumps(result))
    finally:
        conn.close()


def spmd_launch(fn: Callable, args: Sequence, devices: int) -> dict:
    """Runs ``fn(devices, *args)`` in a fresh process holding ``devices`` virtual CPU
    devices, with the XLA runtime settings ``xla_fsdp.launch`` gives its device process (the
    same CPU client for every competitor). Raises ``LaunchError`` as ``launch`` does."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    with environment_for_child(environment(devices)):  # before torch_xla starts in the child
        process = ctx.Process(target=_child, args=(sender, fn, (devices, *args)))
        process.start()
    sender.close()
    try:
        status, value = pickle.loads(receiver.recv_bytes())
    except EOFError:
        process.join()
        raise LaunchError(f"the SPMD process died (exit code {process.exitcode})") from None
    process.join()
    if status != "ok":
        raise LaunchError(f"the SPMD process raised {value}")
    return value


# -- one run --------------------------------------------------------------------------------
class ShardedOutput(nn.Module):
    """A block whose output is sharded along the batch, traceably (for scan_layers)."""

    def __init__(self, block: nn.Module, mesh) -> None:
        super().__init__()
        self.block, self.mesh = block, mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch_xla.distributed.spmd as xs
        spec = ("fsdp",) + (None,) * (x.dim() - 1)
        return xs.mark_sharding_with_gradients(self.block(x), self.mesh, spec)


def _no_output_sharding(output, mesh) -> None:
    return None


def wrap_spmd(model: GPT, impl: str, mesh) -> nn.Module:
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel as FSDPv2)
    if impl == "spmd_unwrapped":
        import torch_xla
        return model.to(torch_xla.device())
    if impl == "fsdpv2":
        policy = functools.partial(transformer_auto_wrap_policy,
                                   transformer_layer_cls={Block})
        return FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
    if impl == "fsdpv2_scan":
        model.blocks = nn.ModuleList(
            ShardedOutput(FSDPv2(block, mesh=mesh, shard_output=_no_output_sharding), mesh)
            for block in model.blocks)
        model.scan_layers = True
        return FSDPv2(model, mesh=mesh)
    raise ValueError(f"unknown SPMD variant {impl!r}")


def run_spmd(devices: int, impl: str, cfg: Config, marks_dir: Optional[str],
             launched_at: float) -> dict:
    """``train`` on one SPMD process; the same keys as ``train.run_rank``."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    if xr.global_runtime_device_count() != devices:
        raise RuntimeError(f"asked for {devices} devices, XLA has "
                           f"{xr.global_runtime_device_count()}")
    mesh = xs.Mesh(np.arange(devices), (devices, 1), ("fsdp", "model"))
    xs.set_global_mesh(mesh)
    device = torch_xla.device()

    def make_batch(step):
        parts = [batch(cfg, rank, step) for rank in range(devices)]
        out = []
        for tensors in zip(*parts):  # row block r is rank r's batch
            t = torch.cat(tensors).to(device)
            xs.mark_sharding(t, mesh, ("fsdp", None))
            out.append(t)
        return tuple(out)

    def build():
        model = wrap_spmd(build_model(cfg), impl, mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    return train(build, make_batch, cfg.steps, marks_dir, launched_at)
