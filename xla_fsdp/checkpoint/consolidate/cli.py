"""``consolidate_sharded_ckpts``: per-rank FSDP checkpoints to one ordinary state dict (model
and optimizer), or to a set of per-rank checkpoints for another number of ranks.

Writes a ``.pth`` or ``.safetensors`` file, a Hugging Face directory as ``save_pretrained``
writes it (``--format hf``), or a DCP directory in the layout PyTorch FSDP2 and torchtitan
load (``--format dcp``). Accepts torch_xla's flags (``--ckpt_prefix``,
``--ckpt_suffix``, ``--save_path``) and reads
checkpoints written by torch_xla's FSDP as well as by ``xla_fsdp.checkpoint.save_sharded``.
Tensors are streamed one at a time from the shard files to the output, so memory stays near
the size of the largest tensor whatever the checkpoint's size. Inputs are never modified;
outputs are written to a temporary file and renamed into place when complete.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import List, Optional, Sequence

from ..formats.dcp.layout import KEY_SCHEMES
from ..files import CheckpointError, CheckpointFile, atomic_paths
from ..formats.per_rank import RANK_FILES, sharded_checkpoint_path
from ..formats.keys import MODEL
from ..writers.formats import FORMATS, OutputOptions, write_output
from ..writers.hf_directory import DEFAULT_MAX_SHARD_SIZE
from ..per_rank.optimizer import optimizer_param_keys
from ..per_rank.plan import plan_model
from ..per_rank.unwrapped import unwrapped_state
from .library import output_paths
from .redistribute import redistribute
from ..per_rank.shard_set import find_shard_set, prefix_in_directory

DEFAULT_SUFFIX = RANK_FILES


def parse_args(argv: Optional[Sequence[str]], default_suffix: str = DEFAULT_SUFFIX
               ) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="consolidate_sharded_ckpts",
        description="Consolidate per-rank FSDP checkpoints into one state dict, or reshard "
                    "them for another number of ranks.")
    p.add_argument("--ckpt_prefix", required=True,
                   help="path prefix of the per-rank files, or a CheckpointManager step "
                        "directory holding them")
    p.add_argument("--ckpt_suffix", default=default_suffix,
                   help=f"glob completing the prefix to the per-rank files "
                        f"(default {default_suffix!r})")
    p.add_argument("--save_path", default="",
                   help="output file (default: <prefix>_consolidated.pth or .safetensors), or "
                        "directory with --format dcp (default: <prefix>_dcp); with --reshard, "
                        "the output prefix (default: <prefix>_reshard<N>)")
    p.add_argument("--format", choices=FORMATS, default="pt",
                   help="pt: {'model', 'optimizer', 'optimizer_param_names'} (and 'extra' "
                        "when the save had one) for torch.load; "
                        "safetensors: the model state dict, optimizer beside it as "
                        "<save_path stem>.optimizer.pth; hf: a directory for from_pretrained "
                        "(model weights only; default <prefix>_hf); dcp: a torch.distributed.checkpoint "
                        "directory as get_state_dict + dcp.save of the unwrapped model and "
                        "optimizer write it, for PyTorch FSDP2 and torchtitan")
    p.add_argument("--dcp_keys", choices=sorted(KEY_SCHEMES), default="get_state_dict",
                   help="with --format dcp: the keys of get_state_dict + dcp.save ('model.<name>'"
                        ", what FSDP2's recipe loads) or of torchtitan's checkpointer (bare "
                        "model names, flattened optimizer)")
    p.add_argument("--hf_config", default="",
                   help="with --format hf: config.json, or the directory holding it (and "
                        "generation_config.json); checked against the weights, copied over")
    p.add_argument("--max_shard_size", default=DEFAULT_MAX_SHARD_SIZE,
                   help=f"with --format hf: the largest file, as save_pretrained takes it "
                        f"(default {DEFAULT_MAX_SHARD_SIZE})")
    p.add_argument("--reshard", type=int, metavar="N", default=0,
                   help="write per-rank checkpoints for N ranks instead of consolidating")
    p.add_argument("--no_optimizer", action="store_true", help="leave the optimizer state out")
    p.add_argument("--no_verify", action="store_true",
                   help="skip the CRC-32 check of every input record before reading")
    return p.parse_args(argv)


class Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second; where stderr is
    not a terminal (a log file, a pipe), a line of its own every ten seconds and at the end,
    so that the log holds no carriage returns."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.label = max(total, 1), 0, label
        self._last = 0.0
        self._start = time.monotonic()
        self._terminal = sys.stderr.isatty()

    def __call__(self, numel: int) -> None:
        finishing = self.done < self.total <= self.done + numel
        self.done += numel
        now = time.monotonic()
        if now - self._last > (0.1 if self._terminal else 10.0) or finishing:
            self._last = now
            fraction = min(self.done / self.total, 1.0)
            bar = "#" * int(30 * fraction)
            line = (f"{self.label} [{bar:<30}] {fraction:6.1%} "
                    f"{self.done / 1e6:,.1f}M elements, {now - self._start:.1f}s")
            sys.stderr.write(f"\r{line}" if self._terminal else f"{line}\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self._terminal:
            sys.stderr.write("\n")


def run(args: argparse.Namespace, skip_outputs: bool = False) -> List[str]:
    """Consolidates or redistributes as ``args`` say; returns the paths written. An output that
    matches the input pattern is refused, or with ``skip_outputs`` left out of the inputs."""
    source = prefix_in_directory(args.ckpt_prefix, args.ckpt_suffix)
    # given a step directory, the outputs go beside it, not into it: a manager's retention
    # removes the directory
    prefix = args.ckpt_prefix if source == args.ckpt_prefix else \
        os.path.normpath(args.ckpt_prefix)
    if args.reshard:
        if args.reshard < 1:
            raise CheckpointError(f"--reshard must be at least 1, got {args.reshard}")
        out_prefix = args.save_path or f"{prefix}_reshard{args.reshard}"
        outputs = [sharded_checkpoint_path(out_prefix, r, args.reshard)
                   for r in range(args.reshard)]
    else:
        outputs = output_paths(args.format, args.save_path, prefix)
    shards = find_shard_set(source, args.ckpt_suffix, outputs, verify=not args.no_verify,
                            skip_outputs=skip_outputs)
    print(f"found {shards.world_size} rank files matching {shards.pattern!r}"
          + ("" if args.no_verify else ", every record's CRC-32 checked"))
    with contextlib.closing(shards):
        model = shards.files[0].tree[MODEL]
        plan = plan_model(shards)
        reason = None if args.no_optimizer else optimizer_param_keys(shards, plan)[1]
        with_optimizer = not args.no_optimizer and reason is None
        if reason and "no optimizer" not in reason:
            print(f"optimizer state not included: {reason}")
        progress = Progress(sum(g.numel for g in plan.shard_groups)
                            + sum(model[k].numel for k in plan.buffers),
                            "resharding" if args.reshard else "consolidating")
        if args.reshard:
            with atomic_paths(outputs) as staged, contextlib.ExitStack() as stack:
                tmps = [stack.enter_context(staged[p].writing()) for p in outputs]
                redistribute(shards, plan, args.reshard, tmps, with_optimizer, progress)
            progress.close()
            for path in outputs:
                with CheckpointFile(path) as f:
                    f.verify()
            print(f"verified: {len(outputs)} rank files for world size {args.reshard}, "
                  f"CRC-32 ok, e.g. {outputs[0]}")
            return outputs
        if args.format == "hf" and with_optimizer:
            print("optimizer state not included: an HF directory holds the model only "
                  "(--format pt or dcp keep it)")
        options = OutputOptions(args.dcp_keys, args.hf_config, args.max_shard_size)
        state = unwrapped_state(shards, plan, with_optimizer and args.format != "hf")
        written, summary = write_output(state, args.format, outputs[0], options, progress)
        progress.close()
        print(f"verified {written[0]}: {summary}; names, shapes and dtypes as the shard "
              f"metadata describes")
        return written


def main(argv: Optional[Sequence[str]] = None, torch_xla_defaults: bool = False) -> int:
    """The command line tool. ``torch_xla_defaults``: torch_xla's default ``--ckpt_suffix``
    (``*.pth``, which also matches the default output; the output is then left out of the
    inputs rather than refused)."""
    args = parse_args(argv, "*.pth" if torch_xla_defaults else DEFAULT_SUFFIX)
    try:
        run(args, skip_outputs=torch_xla_defaults)
    except (CheckpointError, OSError) as exc:   # an unwritable or misnamed output too
        what = "" if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: "
        print(f"consolidate_sharded_ckpts: error: {what}{exc}\nnothing was written",
              file=sys.stderr)
        return 2
    return 0
