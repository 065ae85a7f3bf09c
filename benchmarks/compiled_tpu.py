"""The ``compiled`` benchmark's step as a TPU compiler sees it: the programs xla_fsdp runs
per step eagerly and under ``torch.compile(root, backend="openxla")``, each compiled by
libtpu for a TPU slice, side by side.

    python benchmarks/compiled_tpu.py [--topology v5e:2x2] [--layers 8] [--dim 512]

The step is run on as many virtual devices as the slice has chips; rank 0 records the HLO
of every program its step runs: the compiled forward and backward programs (as torch_xla's
openxla bridge compiles them) and, at the step's ``torch_xla.sync()``, the pending graph
with its donations (the whole step eagerly; the optimizer's update under compile). The
programs are then compiled by libtpu (``xla_fsdp.aot.tpu_compiler``) and read back:
memory per chip, FLOPs, and how the schedule runs each collective (asynchronous, overlapped
with compute: [Note: what counts as overlapped] in ``xla_fsdp.aot.tpu_schedule``). A
step's peak is its largest program's, plus what lives across programs without being one's
argument (AdamW's moments during the forward and backward programs). The autograd seed's
sync (one scalar) is left out. These are the compiler's figures, not measurements.

Needs the compiler (``python -m xla_fsdp.aot install``), the installed package and the
repository root on ``sys.path`` (run from the root). Writes
benchmarks/results/compiled_tpu.md (``--out`` for another file).
"""
import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import write_result  # noqa: E402

STEPS = 2  # the programs are compiled in the first step; the second's sync is recorded


def record_programs(rank, mode, layers, dim):
    """Rank 0's programs for one step of ``mode``: [(what, HLO text)]."""
    import torch
    import torch_xla

    from scripts.bench.model import Config, batch, build_model, wrap
    from scripts.bench.compiled_programs import compiled_programs
    from xla_fsdp.aot.traced.step_graphs import StepGraphs

    cfg = Config(layers=layers, dim=dim, steps=STEPS)
    device = torch_xla.device()
    model = wrap(build_model(cfg), "xla_fsdp", "defaults")
    if mode == "compiled":
        model = torch.compile(model, backend="openxla")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    last_sync = ""
    # the bridge is process-wide: rank 0 records every rank's compiles (the same programs)
    recording = compiled_programs() if rank == 0 else contextlib.nullcontext([])
    with recording as compiled:
        for step in range(STEPS):
            x, y = (t.to(device) for t in batch(cfg, rank, step))
            optimizer.zero_grad(set_to_none=True)
            loss = model(x, y)
            loss.backward()
            optimizer.step()
            if step == STEPS - 1 and rank == 0:
                last_sync = StepGraphs(str(device))._capture().hlo
            torch_xla.sync()
    names = ["forward program", "backward program"] + [
        f"program {i + 1}" for i in range(2, len(compiled))]
    programs = list(zip(names, compiled)) + [
        ("the step's sync" if mode == "eager" else "optimizer step", last_sync)]
    # AdamW's moments, float32, of this rank's shards (what parameters() yields)
    moments = sum(2 * p.numel() * 4 for p in model.parameters())
    return {"programs": programs, "moments": moments}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "compiled_tpu.md"))
    args = ap.parse_args()

    from xla_fsdp import launch
    from xla_fsdp.aot import tpu_compiler
    from xla_fsdp.aot.tpu_schedule import collectives, traced_collectives
    from xla_fsdp.aot.topology import resolve

    slice_ = resolve(args.topology)
    rows, peaks = [], {}
    for mode in ("eager", "compiled"):
        got = launch(record_programs, (mode, args.layers, args.dim),
                     num_devices=slice_.chips)[0]
        programs = [tpu_compiler.Program(hlo, slice_.chips, 1) for _, hlo in got["programs"]]
        compiled = tpu_compiler.compile_programs(slice_.name, programs).programs
        step_peak = 0
        for (what, hlo), c in zip(got["programs"], compiled):
            if c.status != "ok":
                rows.append(f"| {mode} | {what} | {c.status}: {c.message.splitlines()[0]} |"
                            + " |" * 6)
                continue
            memory = c.memory
            found = collectives(c.optimized_hlo, slice_.chips, traced_collectives(hlo))
            kinds = sorted({k.kind for k in found})
            summary = ", ".join(
                f"{kind} {sum(k.count for k in found if k.kind == kind)} "
                f"({sum(k.count for k in found if k.kind == kind and k.overlapped)} overlapped)"
                for kind in kinds) or "none"
            # AdamW's moments live through the forward and backward programs without
            # being their arguments; the eager step and the update take them as arguments
            outside = got["moments"] if "program" in what else 0
            step_peak = max(step_peak, memory["peak_memory_in_bytes"] + outside)
            rows.append(
                f"| {mode} | {what} | {memory['peak_memory_in_bytes'] / 2**20:.1f} | "
                f"{memory['argument_size_in_bytes'] / 2**20:.1f} | "
                f"{memory['output_size_in_bytes'] / 2**20:.1f} | "
                f"{memory['temp_size_in_bytes'] / 2**20:.1f} | "
                f"{c.cost.get('flops', 0.0) / 1e9:.2f} | {summary} |")
        peaks[mode] = step_peak
    lines = [f"# The compiled step as libtpu compiles it ({slice_.name}, {slice_.chips} chips)",
             "",
             f"`python benchmarks/compiled_tpu.py --topology {args.topology} --layers "
             f"{args.layers} --dim {args.dim}`; the `compiled` benchmark's GPT, AdamW, every "
             f"block a unit. Each program of one step of rank 0, compiled by libtpu for "
             f"{slice_.name}: the compiler's figures per chip, not measurements.", "",
             "| mode | program | peak MiB | arguments MiB | outputs MiB | temporaries MiB "
             "| GFLOPs | collectives (overlapped with compute) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"] + rows + [
             "",
             f"Step peak per chip (largest program, plus AdamW's moments, "
             f"{got['moments'] / 2**20:.1f} MiB, where they are not "
             f"its arguments): eager {peaks['eager'] / 2**20:.1f} MiB, compiled "
             f"{peaks['compiled'] / 2**20:.1f} MiB "
             f"({peaks['compiled'] / peaks['eager']:.2f}x)."]
    write_result(args.out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
