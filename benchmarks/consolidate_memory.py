"""Peak memory and time of consolidating a >= 1 GB sharded checkpoint: xla_fsdp's
``consolidate_sharded_ckpts`` (to a ``.pth`` file, and to a DCP directory with ``--format
dcp``) against torch_xla's ``consolidate_sharded_model_checkpoints``, side by side on the
same files, each run in a fresh process (peak RSS from wait4).

    python benchmarks/consolidate_memory.py [--gb 1.0] [--world 4] [--repeats 3]

Needs the installed package (``pip install -e .``). Writes
benchmarks/results/consolidate_memory.md (``--out`` for another file).
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from common import size_args, write_result

from xla_fsdp.checkpoint import sharded_checkpoint_path
from xla_fsdp.checkpoint.files import TorchFileWriter
from xla_fsdp.checkpoint.formats.per_rank import wrapping_fingerprint

SEP = "_FSDP_SHARD_SEPARATOR_"


def model_shapes(total_bytes):
    """A few large matrices (the largest is a quarter of the model) and many small tensors."""
    big = total_bytes // 4 // 4            # float32 elements in the largest tensor
    cols = 4096
    shapes = {f"layers.{i}.weight": (big // cols, cols) for i in range(3)}
    shapes["embed.weight"] = (big // cols - 1, cols)
    for i in range(200):
        shapes[f"layers.{i}.norm.weight"] = (cols + i,)
    return shapes


def flat_shard(full, rank, world):
    """Rank ``rank``'s shard of an unflattened parameter in torch_xla's flat layout: the
    tensor flattened, zero-padded to a multiple of ``world`` elements, cut in ``world``
    equal pieces (a new tensor, not a view)."""
    flat = full.reshape(-1)
    size = -(-flat.numel() // world)
    piece = flat[rank * size:(rank + 1) * size]
    return torch.cat([piece, piece.new_zeros(size - piece.numel())])


def write_checkpoint(prefix, shapes, world):
    """Per-rank files in the shared (torch_xla-compatible) format, one tensor at a time."""
    def key(name):
        return ("_fsdp_shard._fsdp_wrapped_module." + name).replace(".", SEP)
    metadata = {"shard_info": {"": {key(n): {"_orig_size": torch.Size(s),
                                            "_orig_name": "_fsdp_wrapped_module." + n}
                                    for n, s in shapes.items()}},
                "flatten_info": {}, "buffer_info": {}, "shared_info": {},
                "layout_info": {"": {key(n): {"kind": "flat", "multiple": 1} for n in shapes}},
                "param_order": list(shapes), "world_size": world}
    for rank in range(world):
        writer = TorchFileWriter(sharded_checkpoint_path(prefix, rank, world))
        model = {}
        for i, (name, shape) in enumerate(shapes.items()):
            g = torch.Generator().manual_seed(i)
            full = torch.randn(shape, generator=g)
            model[key(name)] = writer.add(flat_shard(full, rank, world))
            del full
        md = dict(metadata, rank=rank)
        writer.finish({"model": model, "shard_metadata": md,
                       "xla_fsdp": {"format": 1, "world_size": world, "rank": rank,
                                    "fingerprint": wrapping_fingerprint(md), "save_index": 1,
                                    "optimizer_param_keys": None}})


def _dcp_equal(directory, expected):
    """Whether the DCP directory holds ``expected`` under ``model.<name>``, read one tensor at
    a time."""
    import torch.distributed.checkpoint as dcp
    stored = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    if sorted(stored) != sorted("model." + k for k in expected):
        return False
    for name, want in expected.items():
        got = {"model": {name: torch.empty_like(want)}}
        dcp.load(got, checkpoint_id=directory, no_dist=True)
        if not torch.equal(got["model"][name], want):
            return False
    return True


def peak_rss(cmd):
    """(peak resident set in bytes, wall seconds) of a child process."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {proc.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss * 1024, elapsed


def main():
    args = size_args("consolidate_memory.md")
    shapes = model_shapes(int(args.gb * 2**30))
    largest = max(torch.Size(s).numel() for s in shapes.values()) * 4
    total = sum(torch.Size(s).numel() for s in shapes.values()) * 4
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        prefix = os.path.join(d, "ckpt")
        write_checkpoint(prefix, shapes, args.world)
        ours_out, theirs_out = os.path.join(d, "ours.pth"), os.path.join(d, "theirs.pth")
        dcp_out = os.path.join(d, "ours_dcp")
        runs = {
            "xla_fsdp consolidate_sharded_ckpts": [
                sys.executable, "-m", "xla_fsdp.checkpoint.consolidate", "--ckpt_prefix", prefix,
                "--save_path", ours_out],
            "xla_fsdp consolidate_sharded_ckpts --format dcp": [
                sys.executable, "-m", "xla_fsdp.checkpoint.consolidate", "--ckpt_prefix", prefix,
                "--format", "dcp", "--save_path", dcp_out],
            "torch_xla consolidate_sharded_model_checkpoints": [
                sys.executable, "-c",
                "import sys; from torch_xla.distributed.fsdp import "
                "consolidate_sharded_model_checkpoints as c; c(sys.argv[1], sys.argv[2], "
                "sys.argv[3])", prefix, "_rank-*-of-*.pth", theirs_out],
        }
        ours_import = [sys.executable, "-c", "import xla_fsdp.checkpoint.consolidate.cli"]
        baselines = {
            "xla_fsdp consolidate_sharded_ckpts": ours_import,
            "xla_fsdp consolidate_sharded_ckpts --format dcp": ours_import,
            "torch_xla consolidate_sharded_model_checkpoints": [
                sys.executable, "-c", "import torch_xla.distributed.fsdp"],
        }
        results = {name: {"rss": [], "time": []} for name in runs}
        for _ in range(args.repeats):
            for name, cmd in runs.items():   # interleaved, so drift hits both alike
                rss, seconds = peak_rss(cmd)
                results[name]["rss"].append(rss)
                results[name]["time"].append(seconds)
        base = {name: peak_rss(cmd)[0] for name, cmd in baselines.items()}
        ours = torch.load(ours_out, mmap=True, weights_only=True)["model"]
        theirs = torch.load(theirs_out, mmap=True, weights_only=True)["model"]
        identical = sorted(ours) == sorted(theirs) and all(
            torch.equal(ours[k], theirs[k]) for k in theirs)
        identical = identical and _dcp_equal(dcp_out, theirs)
    lines = [
        "# Consolidation memory: xla_fsdp vs torch_xla",
        "",
        f"Command: `python benchmarks/consolidate_memory.py --gb {args.gb} --world "
        f"{args.world} --repeats {args.repeats}`",
        "",
        f"Checkpoint: {args.world} rank files, {total / 2**30:.2f} GiB of float32 parameters "
        f"in {len(shapes)} tensors; the largest consolidated tensor is "
        f"{largest / 2**20:.0f} MiB. Machine: {os.cpu_count()} cores. Peak RSS from `wait4`; "
        f"'import only' is the same interpreter importing the tool and doing nothing.",
        "",
        "| tool | peak RSS (median) | import only | peak minus import | "
        "(peak minus import) / largest tensor | time (median) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        rss, sec = statistics.median(r["rss"]), statistics.median(r["time"])
        lines.append(f"| {name} | {rss / 2**20:,.0f} MiB | {base[name] / 2**20:,.0f} MiB | "
                     f"{(rss - base[name]) / 2**20:,.0f} MiB | {(rss - base[name]) / largest:.2f} | "
                     f"{sec:.1f} s |")
    names = list(results)
    theirs_peak = statistics.median(results[names[-1]]["rss"])
    ratios = ", ".join(f"{theirs_peak / statistics.median(results[n]['rss']):.1f}x {n}'s"
                       for n in names[:-1])
    lines += ["", f"torch_xla's peak is {ratios}. Outputs identical (the DCP directory read "
                  f"back with dcp.load): {identical}.",
              "Raw peaks (MiB): " + "; ".join(
                  f"{n}: {[round(x / 2**20) for x in r['rss']]}" for n, r in results.items()),
              "Raw times (s): " + "; ".join(
                  f"{n}: {[round(x, 1) for x in r['time']]}" for n, r in results.items())]
    write_result(args.out, lines)


if __name__ == "__main__":
    main()
