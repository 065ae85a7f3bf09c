"""Host memory and time of loading a consolidated checkpoint into a sharded model (and its
AdamW state), per rank, against what users do without ``load_consolidated``: every rank
``torch.load``s the whole file and hands it to ``load_full_state_dict`` /
``load_full_optim_state_dict``. Also what ``save_consolidated`` adds while one rank writes.

    python benchmarks/load_memory.py [--gb 1.0] [--world 4] [--repeats 3]

A stack of bias-free linear layers (``--gb`` of float32 parameters, one FSDP unit each),
AdamW after one step, at N = ``--world`` virtual devices, saved once with
``save_consolidated`` as ``.pth`` and as ``.safetensors`` (+ ``.optimizer.pth``). All ranks
are threads of one process and load at once, so the peak resident set during a load, less
the resident set before (``common.reset_peak``), is what the N ranks' loads add together;
divided by N, what one rank's load adds. With ``first_rank_reads`` the first rank does
the reading, so its figure is the whole and the others' close to nothing; the per-rank
figure is then an average. On a TPU or Trainium host each rank is a process of its own.

Needs the installed package (``pip install -e .``). Writes
benchmarks/results/load_memory.md (``--out`` for another file).
"""
import os
import statistics

import torch

from common import (WIDTH, launch_with_directory, measured_turns, size_args, stack_layers,
                    trained_stack, write_result)


def _loaders(directory):
    from xla_fsdp.checkpoint import load_consolidated, save_consolidated
    pth = os.path.join(directory, "ck.pth")
    st = os.path.join(directory, "ck.safetensors")

    def whole_file(rank, model, opt):
        saved = torch.load(pth, weights_only=True)
        model.load_full_state_dict(saved["model"])
        model.load_full_optim_state_dict(opt, saved["optimizer"], saved["optimizer_param_names"])

    def save(rank, model, opt):
        save_consolidated(os.path.join(directory, "again.pth"), model, opt)
    return {
        "load_consolidated (.pth)": lambda rank, model, opt: load_consolidated(pth, model, opt),
        "load_consolidated (.safetensors + .optimizer.pth)":
            lambda rank, model, opt: load_consolidated(st, model, opt),
        "load_consolidated (.pth, first_rank_reads)":
            lambda rank, model, opt: load_consolidated(pth, model, opt, first_rank_reads=True),
        "torch.load of the file on every rank + load_full_state_dict + "
        "load_full_optim_state_dict": whole_file,
        "save_consolidated (.pth; the first rank writes)": save,
    }


def _run(rank, layers, repeats, directory):
    from xla_fsdp.checkpoint import save_consolidated
    model, opt, own = trained_stack(layers)
    for fmt, name in (("pt", "ck.pth"), ("safetensors", "ck.safetensors")):
        save_consolidated(os.path.join(directory, name), model, opt, format=fmt)
    results = measured_turns(rank, _loaders(directory), repeats,
                             lambda load, turn: load(rank, model, opt))
    return {"own": own, "results": results}


def main():
    args = size_args("load_memory.md")
    layers = stack_layers(args.gb)
    out = launch_with_directory(_run, (layers, args.repeats), args.world)
    own = out[0]["own"]
    model_bytes = layers * WIDTH * WIDTH * 4
    lines = [
        "# Loading a consolidated checkpoint: host memory and time per rank",
        "",
        f"Command: `python benchmarks/load_memory.py --gb {args.gb} --world {args.world} "
        f"--repeats {args.repeats}`",
        "",
        f"Model: {layers} linear layers of {WIDTH}x{WIDTH} float32 ({model_bytes / 2**30:.2f} "
        f"GiB of parameters), one FSDP unit each, AdamW after one step, N = {args.world} "
        f"virtual devices; the checkpoint holds the model and AdamW's state "
        f"({3 * model_bytes / 2**30:.2f} GiB). What one rank holds (its shards and their "
        f"optimizer state): {own / 2**20:,.0f} MiB; the largest shard group (one layer), "
        f"{WIDTH * WIDTH * 4 / 2**20:,.0f} MiB. Machine: {os.cpu_count()} cores. The memory "
        f"an operation adds is the process's peak resident set during it (VmHWM, reset "
        f"before each) less its resident set before, for all N ranks together (they are "
        f"threads of one process), and divided by N.",
        "",
        "| operation | added, all ranks: median (largest) | per rank | per rank / what the "
        "rank holds | time (median) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, runs in out[0]["results"].items():
        added = statistics.median(r[0] for r in runs)
        largest = max(r[0] for r in runs)
        seconds = statistics.median(r[1] for r in runs)
        lines.append(f"| {name} | {added / 2**20:,.0f} MiB ({largest / 2**20:,.0f} MiB) | "
                     f"{added / args.world / 2**20:,.0f} MiB | {added / args.world / own:.2f} "
                     f"| {seconds:.1f} s |")
    lines += ["", "Raw (MiB added, all ranks; s): " + "; ".join(
        f"{name}: {[round(r[0] / 2**20) for r in runs]}, {[round(r[1], 1) for r in runs]}"
        for name, runs in out[0]["results"].items())]
    write_result(args.out, lines)


if __name__ == "__main__":
    main()
