"""Host memory and time of saving a checkpoint from training code, per rank: ``save_dcp`` (both
key schemes) against ``save_sharded`` (our per-rank files) and torch_xla's recipe
(``xm.save`` of ``model.state_dict()`` and ``optimizer.state_dict()`` on every rank), in the
same run on the same trained model.

    python benchmarks/save_memory.py [--gb 1.0] [--world 4] [--repeats 3]

A stack of bias-free linear layers (``--gb`` of float32 parameters, one FSDP unit each), AdamW
after one step, at N = ``--world`` virtual devices. All ranks are threads of one process and
save at once, so the process's peak resident set during a save, less its resident set just
before, is what the N ranks' saves add together; divided by N, what one rank's save adds.
The peak is the kernel's high-water mark (``VmHWM``), reset before every save by writing 5
to ``/proc/self/clear_refs``. Large allocations are their own mappings
(``MALLOC_MMAP_THRESHOLD_``), and the garbage collector and ``malloc_trim`` run before each
save, so memory an earlier save left is returned rather than reused unseen. The savers take turns in a rotating order, after
one unrecorded save each. On a TPU or Trainium host each rank is a process of its own
and its save adds the per-rank figure to that process.

Needs the installed package (``pip install -e .``). Writes
benchmarks/results/save_memory.md (``--out`` for another file).
"""
import os
import shutil
import statistics
import tempfile
import time

import torch

from common import peak_added, reset_peak, size_args, write_result

WIDTH = 4096


def _empty(directory):
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _savers(directory):
    import torch_xla.core.xla_model as xm
    from xla_fsdp.checkpoint import save_dcp, save_sharded

    def torch_xla_recipe(rank, model, opt, i):
        path = os.path.join(directory, f"recipe{i}_rank-{rank}")
        xm.save({"model": model.state_dict(), "shard_metadata": model.get_shard_metadata(),
                 "optimizer": opt.state_dict()}, path, master_only=False)
    return {
        "save_dcp (get_state_dict keys)":
            lambda rank, model, opt, i: save_dcp(os.path.join(directory, f"dcp{i}"), model, opt),
        "save_dcp (torchtitan keys)":
            lambda rank, model, opt, i: save_dcp(os.path.join(directory, f"tt{i}"), model, opt,
                                                 keys="torchtitan"),
        "save_sharded":
            lambda rank, model, opt, i: save_sharded(os.path.join(directory, f"files{i}"),
                                                     model, opt),
        "torch_xla recipe (xm.save per rank)": torch_xla_recipe,
    }


def _run(rank, layers, repeats, directory):
    import torch_xla
    import torch_xla.core.xla_model as xm
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                  for _ in range(layers)])
    model = FSDP(torch.nn.Sequential(*[FSDP(m) for m in model]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, WIDTH, device=torch_xla.device())).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch_xla.sync()
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    own += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v))
    results = {}
    savers = list(_savers(directory).items())
    for name, save in savers:  # once each unrecorded: first-call costs (imports, threads)
        save(rank, model, opt, "warmup")
        xm.rendezvous("warm")
        if rank == 0:
            _empty(directory)
        xm.rendezvous("emptied")
    for i in range(repeats):
        for name, save in savers[i % len(savers):] + savers[:i % len(savers)]:
            xm.rendezvous("before")
            if rank == 0:
                before = reset_peak()
            xm.rendezvous("reset")
            start = time.monotonic()
            save(rank, model, opt, i)
            xm.rendezvous("saved")
            if rank == 0:
                results.setdefault(name, []).append(
                    (peak_added(before), time.monotonic() - start))
                _empty(directory)
    return {"own": own, "results": results}


def main():
    from xla_fsdp import launch
    args = size_args("save_memory.md")
    layers = max(1, round(args.gb * 2**30 / (WIDTH * WIDTH * 4)))
    directory = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # the device process inherits it
    try:
        out = launch(_run, (layers, args.repeats, directory), num_devices=args.world)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    own = out[0]["own"]
    model_bytes = layers * WIDTH * WIDTH * 4
    lines = [
        "# Saving from training code: host memory and time per rank",
        "",
        f"Command: `python benchmarks/save_memory.py --gb {args.gb} --world {args.world} "
        f"--repeats {args.repeats}`",
        "",
        f"Model: {layers} linear layers of {WIDTH}x{WIDTH} float32 ({model_bytes / 2**30:.2f} "
        f"GiB of parameters), one FSDP unit each, AdamW after one step, N = {args.world} "
        f"virtual devices. What one rank holds (its shards and their optimizer state): "
        f"{own / 2**20:,.0f} MiB. Machine: {os.cpu_count()} cores. The memory a save adds "
        f"is the process's peak resident set during it (VmHWM, reset before each save) less "
        f"its resident set before, divided by N: every rank saves at once in this process.",
        "",
        "| save | added per rank: median (largest) | median / what the rank holds | "
        "time (median) |",
        "| --- | --- | --- | --- |",
    ]
    for name, runs in out[0]["results"].items():
        added = statistics.median(r[0] for r in runs) / args.world
        largest = max(r[0] for r in runs) / args.world
        seconds = statistics.median(r[1] for r in runs)
        lines.append(f"| {name} | {added / 2**20:,.0f} MiB ({largest / 2**20:,.0f} MiB) | "
                     f"{added / own:.2f} | {seconds:.1f} s |")
    lines += ["", "Raw (MiB added per rank; s): " + "; ".join(
        f"{name}: {[round(r[0] / args.world / 2**20) for r in runs]}, "
        f"{[round(r[1], 1) for r in runs]}" for name, runs in out[0]["results"].items())]
    write_result(args.out, lines)


if __name__ == "__main__":
    main()
