"""What a host read in the optimizer step costs: torch's Adafactor, Hugging Face's Adafactor
(``scale_parameter=True``) and GradScaler over AdamW, each under ours, ours with the sync
before the reads switched off ([Note: a host read runs the graph behind it again] in
``xla_fsdp/_unit/step_reads.py``), torch_xla's FSDP and the unwrapped model, in one launch.

    python benchmarks/step_reads.py [--world 2] [--layers 4] [--width 512] [--rounds 3]

A stack of linear layers (one unit each, then the root) at N = ``--world`` virtual devices;
a step is a forward, backward and optimizer step on a batch of 64 rows per rank and a sync,
the loss read after it. Adafactor steps each rank's slice (``allow_per_shard_statistics``;
torch_xla's FSDP takes it as it is). The implementations' loops alternate, ``STEPS`` steps
each, for ``--rounds`` rounds after one unrecorded round. Per step: the wall time, the
programs torch_xla executed and their execution time (``ExecuteTime``), rank 0's, medians.
Writes benchmarks/results/step_reads.md.
"""
import argparse
import os
import statistics
import time

from common import RESULTS, write_result

STEPS = 6
CASES = ("torch_adafactor", "hf_adafactor", "grad_scaler_adamw")
IMPLS = ("xla_fsdp", "xla_fsdp_unsynced", "torch_xla", "unwrapped")


def _build(impl, case, layers, width):
    import torch
    import torch.nn as nn
    import torch_xla
    torch.manual_seed(0)
    blocks = [nn.Linear(width, width) for _ in range(layers)]
    if impl.startswith("xla_fsdp"):
        from xla_fsdp import FSDP, allow_per_shard_statistics
        model = FSDP(nn.Sequential(*[FSDP(b) for b in blocks]))
    elif impl == "torch_xla":
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as TorchXlaFSDP
        kw = dict(pin_layout_in_collective_ops=False)
        model = TorchXlaFSDP(nn.Sequential(*[TorchXlaFSDP(b.to(torch_xla.device()), **kw)
                                             for b in blocks]), **kw)
    else:
        model = nn.Sequential(*blocks).to(torch_xla.device())
    if case == "torch_adafactor":
        opt = torch.optim.Adafactor(model.parameters(), lr=1e-3)
    elif case == "hf_adafactor":
        from transformers.optimization import Adafactor
        opt = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if impl.startswith("xla_fsdp") and "adafactor" in case:
        allow_per_shard_statistics(opt)
    scaler = torch.amp.GradScaler("xla") if case == "grad_scaler_adamw" else None
    return model, opt, scaler


def _run(rank, cases, impls, layers, width, rounds):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    from xla_fsdp._unit import step_reads
    synced, pinned = step_reads.run_live_graphs, step_reads.pin_update_order
    built = {(c, i): _build(i, c, layers, width) for c in cases for i in impls}
    x = torch.randn(64, width).to(torch_xla.device())

    def executed():
        data = met.metric_data("ExecuteTime")
        return (data[0], data[1]) if data else (0, 0)

    def loop(case, impl):
        model, opt, scaler = built[(case, impl)]
        off = impl == "xla_fsdp_unsynced"
        step_reads.run_live_graphs = (lambda device: None) if off else synced
        step_reads.pin_update_order = (lambda optimizer, device: None) if off else pinned
        rows = []
        for _ in range(STEPS):
            xm.rendezvous("step")   # the other ranks' programs stay out of this one's count
            count, ns = executed()
            start = time.monotonic()
            loss = model(x).pow(2).mean()
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
            torch_xla.sync()
            loss.item()
            wall = time.monotonic() - start
            after_count, after_ns = executed()
            rows.append((wall, after_count - count, (after_ns - ns) / 1e6))
        step_reads.run_live_graphs, step_reads.pin_update_order = synced, pinned
        return rows

    out = {key: [] for key in built}
    for r in range(rounds + 1):
        order = list(built) if r % 2 else list(reversed(built))
        for key in order:
            rows = loop(*key)
            if r > 0:
                out[key] += rows
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--impls", nargs="+", default=list(IMPLS))
    ap.add_argument("--out", default=os.path.join(RESULTS, "step_reads.md"))
    args = ap.parse_args()
    from xla_fsdp import launch
    out = launch(_run, (args.cases, args.impls, args.layers, args.width, args.rounds),
                 num_devices=args.world)[0]
    lines = [
        "# A host read in the optimizer step: what it costs",
        "",
        f"Command: `python benchmarks/step_reads.py --world {args.world} --layers {args.layers} "
        f"--width {args.width} --rounds {args.rounds}`",
        "",
        "Rank 0's medians per step over the recorded rounds. Programs and execution time count "
        "every program torch_xla ran in the process during the step (the virtual devices' "
        "threads take turns, so other ranks' programs of the same step can fall in a rank's "
        "window; the rendezvous before each step keeps earlier steps out).",
        "",
        "| case | implementation | step wall (ms) | programs executed | execution (ms) "
        "| execution / ours |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for case in args.cases:
        med = {i: [statistics.median(r[k] for r in out[(case, i)]) for k in range(3)]
               for i in args.impls}
        ours = med.get("xla_fsdp", [None] * 3)[2]
        for impl in args.impls:
            wall, programs, execute = med[impl]
            ratio = f"{execute / ours:.2f}" if ours else ""
            lines.append(f"| {case} | {impl} | {wall * 1e3:.0f} | {programs:.0f} | "
                         f"{execute:.0f} | {ratio} |")
    write_result(args.out, lines)


if __name__ == "__main__":
    main()
