"""``consolidate_sharded_ckpts``: per-rank FSDP checkpoints to one ordinary state dict (model
and optimizer), or to a set of per-rank checkpoints for another number of ranks.

Accepts torch_xla's flags (``--ckpt_prefix``, ``--ckpt_suffix``, ``--save_path``) and reads
checkpoints written by torch_xla's FSDP as well as by ``xla_fsdp.checkpoint.save_sharded``.
Tensors are streamed one at a time from the shard files to the output, so memory stays near
the size of the largest tensor whatever the checkpoint's size. Inputs are never modified;
outputs are written to a temporary file and renamed into place when complete.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from xla_fsdp.checkpoint import sharded_checkpoint_path
from xla_fsdp.files import CheckpointError, CheckpointFile, SafetensorsWriter, TorchFileWriter
from xla_fsdp.files import atomic_path
from xla_fsdp.files.writer import SAFETENSORS_DTYPES

from .optimizer import consolidate_optimizer, why_not_consolidated
from .plan import ModelPlan, plan_model, read_param
from .reshard import reshard
from .shard_set import ShardSet, find_shard_set

DEFAULT_SUFFIX = "_rank-*-of-*.pth"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="consolidate_sharded_ckpts",
        description="Consolidate per-rank FSDP checkpoints into one state dict, or reshard "
                    "them for another number of ranks.")
    p.add_argument("--ckpt_prefix", required=True,
                   help="path prefix of the per-rank files")
    p.add_argument("--ckpt_suffix", default=DEFAULT_SUFFIX,
                   help=f"glob completing the prefix to the per-rank files "
                        f"(default {DEFAULT_SUFFIX!r}, which never matches this tool's output)")
    p.add_argument("--save_path", default="",
                   help="output file (default: <prefix>_consolidated.pth or .safetensors); with "
                        "--reshard, the output prefix (default: <prefix>_reshard<N>)")
    p.add_argument("--format", choices=("pt", "safetensors"), default="pt",
                   help="pt: {'model', 'optimizer', 'optimizer_param_names'} for torch.load; "
                        "safetensors: the model state dict, optimizer beside it as "
                        "<save_path stem>.optimizer.pth")
    p.add_argument("--reshard", type=int, metavar="N", default=0,
                   help="write per-rank checkpoints for N ranks instead of consolidating")
    p.add_argument("--no_optimizer", action="store_true", help="leave the optimizer state out")
    p.add_argument("--no_verify", action="store_true",
                   help="skip the CRC-32 check of every input record before reading")
    return p.parse_args(argv)


class Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.label = max(total, 1), 0, label
        self._last = 0.0
        self._start = time.monotonic()

    def __call__(self, numel: int) -> None:
        self.done += numel
        now = time.monotonic()
        if now - self._last > 0.1 or self.done >= self.total:
            self._last = now
            fraction = min(self.done / self.total, 1.0)
            bar = "#" * int(30 * fraction)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {fraction:6.1%} "
                             f"{self.done / 1e6:,.1f}M elements, {now - self._start:.1f}s")
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def _total_elements(plan: ModelPlan, shards: ShardSet) -> int:
    model = shards.files[0].tree["model"]
    return sum(g.numel for g in plan.groups) + sum(model[k].numel for k in plan.buffers)


def _ordered_params(plan: ModelPlan) -> List[tuple]:
    """(name, group, param) of every parameter in the unwrapped model's order."""
    by_name = {p.name: (g, p) for g in plan.groups for p in g.params}
    known = set(plan.param_order)
    order = plan.param_order + [n for n in by_name if n not in known]
    return [(n, *by_name[n]) for n in order]


def _model_entries(plan: ModelPlan, shards: ShardSet):
    """(name, tensor) of the consolidated model state dict, read one at a time."""
    files = shards.files
    for name, group, param in _ordered_params(plan):
        yield name, read_param([f.tree["model"][group.key] for f in files], param)
    for key, name in plan.buffers.items():
        tensor = files[0].tree["model"][key].read()
        if key in plan.buffer_dtypes:
            tensor = tensor.to(plan.buffer_dtypes[key])
        yield name, tensor


def _specs(plan: ModelPlan, shards: ShardSet) -> List[tuple]:
    """(name, dtype, shape) of every entry ``_model_entries`` yields, then the aliases."""
    model = shards.files[0].tree["model"]
    specs = [(n, model[g.key].dtype, p.shape) for n, g, p in _ordered_params(plan)]
    specs += [(n, plan.buffer_dtypes.get(k, model[k].dtype), model[k].shape)
              for k, n in plan.buffers.items()]
    source = {n: (d, s) for n, d, s in specs}
    specs += [(alias, *source[src]) for alias, src in plan.aliases]
    return specs


def write_consolidated(shards: ShardSet, plan: ModelPlan, path: str, fmt: str,
                       with_optimizer: bool, progress: Progress) -> List[str]:
    """Writes the consolidated checkpoint; returns the paths written."""
    written = []
    if fmt == "safetensors":
        specs = _specs(plan, shards)
        sources = dict(plan.aliases)
        with atomic_path(path) as tmp:
            writer = SafetensorsWriter(tmp, specs, {"format": "pt"})
            held: Dict[str, torch.Tensor] = {}
            for name, tensor in _model_entries(plan, shards):
                writer.add(name, tensor)
                progress(tensor.numel())
                if name in sources.values():
                    held[name] = tensor  # a tied weight is written again under its alias
            for alias, source in plan.aliases:
                writer.add(alias, held[source])
            writer.finish()
        written.append(path)
        if with_optimizer:
            opt_path = os.path.splitext(path)[0] + ".optimizer.pth"
            with atomic_path(opt_path) as tmp:
                writer = TorchFileWriter(tmp)
                optimizer, names = consolidate_optimizer(shards, plan, writer.add)
                writer.finish({"optimizer": optimizer, "optimizer_param_names": names})
            written.append(opt_path)
        return written
    with atomic_path(path) as tmp:
        writer = TorchFileWriter(tmp)
        model: Dict[str, Any] = {}
        for name, tensor in _model_entries(plan, shards):
            model[name] = writer.add(tensor)
            progress(tensor.numel())
        for alias, source in plan.aliases:
            model[alias] = model[source]  # one record under both names: stays tied on load
        tree: Dict[str, Any] = {"model": model}
        if with_optimizer:
            tree["optimizer"], tree["optimizer_param_names"] = consolidate_optimizer(
                shards, plan, writer.add)
        writer.finish(tree)
    return [path]


def verify_output(path: str, expected: Dict[str, tuple]) -> str:
    """Re-reads a written file: CRCs, and every expected name with its shape and dtype."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            got = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
                   for k in f.keys()}
        expected = {k: (SAFETENSORS_DTYPES[v[0]], tuple(v[1])) for k, v in expected.items()}
    else:
        with CheckpointFile(path) as f:
            f.verify()
            model = f.tree["model"]
            got = {k: (v.dtype, tuple(v.shape)) for k, v in model.items()}
        expected = {k: (v[0], tuple(v[1])) for k, v in expected.items()}
    if got != expected:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise CheckpointError(f"{path} does not hold what was written: missing {missing}, "
                              f"unexpected {extra}, wrong shape or dtype {wrong}")
    numel = sum(math.prod(s) for _, s in expected.values())
    return f"{len(expected)} tensors, {numel:,} elements"


def run(args: argparse.Namespace) -> List[str]:
    prefix = args.ckpt_prefix
    if args.reshard:
        if args.reshard < 1:
            raise CheckpointError(f"--reshard must be at least 1, got {args.reshard}")
        out_prefix = args.save_path or f"{prefix}_reshard{args.reshard}"
        outputs = [sharded_checkpoint_path(out_prefix, r, args.reshard)
                   for r in range(args.reshard)]
    else:
        ext = ".safetensors" if args.format == "safetensors" else ".pth"
        outputs = [args.save_path or prefix + "_consolidated" + ext]
        if args.format == "safetensors":
            outputs.append(os.path.splitext(outputs[0])[0] + ".optimizer.pth")
    shards = find_shard_set(prefix, args.ckpt_suffix, outputs, verify=not args.no_verify)
    print(f"found {shards.world_size} rank files matching {shards.pattern!r}"
          + ("" if args.no_verify else ", every record's CRC-32 checked"))
    try:
        plan = plan_model(shards.metadata, shards.files[0].tree["model"])
        reason = None if args.no_optimizer else why_not_consolidated(shards)
        with_optimizer = not args.no_optimizer and reason is None
        if reason and "no optimizer" not in reason:
            print(f"optimizer state not included: {reason}")
        progress = Progress(_total_elements(plan, shards),
                            "resharding" if args.reshard else "consolidating")
        if args.reshard:
            with contextlib.ExitStack() as stack:
                tmps = [stack.enter_context(atomic_path(p)) for p in outputs]
                reshard(shards, plan, args.reshard, tmps, progress)
            progress.close()
            for path in outputs:
                with CheckpointFile(path) as f:
                    f.verify()
            print(f"verified: {len(outputs)} rank files for world size {args.reshard}, "
                  f"CRC-32 ok, e.g. {outputs[0]}")
            return outputs
        written = write_consolidated(shards, plan, outputs[0], args.format, with_optimizer,
                                     progress)
        progress.close()
        summary = verify_output(written[0], {n: (d, s) for n, d, s in _specs(plan, shards)})
        print(f"verified {written[0]}: {summary}, names, shapes and dtypes as the shard "
              f"metadata describes" + (", optimizer included" if with_optimizer else ""))
        return written
    finally:
        shards.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except CheckpointError as exc:
        print(f"consolidate_sharded_ckpts: error: {exc}\nnothing was written", file=sys.stderr)
        return 2
    return 0
