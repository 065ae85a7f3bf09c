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
import statistics

from common import (WIDTH, empty_directory, launch_with_directory, measured_turns, size_args,
                    stack_layers, torch_xla_recipe, trained_stack, write_result)


def _savers(directory):
    from xla_fsdp.checkpoint import save_dcp, save_sharded

    return {
        "save_dcp (get_state_dict keys)":
            lambda rank, model, opt, i: save_dcp(os.path.join(directory, f"dcp{i}"), model, opt),
        "save_dcp (torchtitan keys)":
            lambda rank, model, opt, i: save_dcp(os.path.join(directory, f"tt{i}"), model, opt,
                                                 keys="torchtitan"),
        "save_sharded":
            lambda rank, model, opt, i: save_sharded(os.path.join(directory, f"files{i}"),
                                                     model, opt),
        "torch_xla recipe (xm.save per rank)": torch_xla_recipe(directory),
    }


def _run(rank, layers, repeats, directory):
    model, opt, own = trained_stack(layers)
    results = measured_turns(rank, _savers(directory), repeats,
                             lambda save, turn: save(rank, model, opt, turn),
                             after=lambda: empty_directory(directory))
    return {"own": own, "results": results}


def main():
    args = size_args("save_memory.md")
    layers = stack_layers(args.gb)
    out = launch_with_directory(_run, (layers, args.repeats), args.world)
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
