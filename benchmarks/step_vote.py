"""What the preemption vote costs a training step: ``CheckpointManager.maybe_save`` at every
step boundary (``every=None``: it never saves, it only votes) against the same loop without
it, in the same run.

    python benchmarks/step_vote.py [--world 4] [--layers 8] [--width 1024] [--rounds 5]

A stack of bias-free linear layers (one FSDP unit each) and AdamW at N = ``--world`` virtual
devices; a step is a forward, backward and AdamW step on a batch of 8, the loss read each
step (``loss.item()``), as a loop that logs does. The two loops alternate, 20 steps each,
for ``--rounds`` rounds after one unrecorded round each; the figure is the median step
time of each, and the difference. Writes benchmarks/results/step_vote.md.
"""
import argparse
import os
import statistics
import tempfile
import time

from common import RESULTS, write_result

STEPS = 20


def _run(rank, layers, width, rounds, directory):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from xla_fsdp import FSDP
    from xla_fsdp.checkpoint import CheckpointManager
    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(*[FSDP(torch.nn.Linear(width, width, bias=False))
                                       for _ in range(layers)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    manager = CheckpointManager(directory, every=None)
    x = torch.ones(8, width, device=torch_xla.device())

    def loop(vote):
        times = []
        for step in range(STEPS):
            start = time.monotonic()
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            torch_xla.sync()
            loss.item()
            if vote:
                manager.maybe_save(step, model, opt)
            times.append(time.monotonic() - start)
        manager.wait()
        xm.rendezvous("loop")
        return times

    out = {"without": [], "with": []}
    for i in range(rounds + 1):
        for name in ("without", "with") if i % 2 else ("with", "without"):
            times = loop(name == "with")
            if i > 0:
                out[name] += times
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(RESULTS, "step_vote.md"))
    args = ap.parse_args()
    from xla_fsdp import launch
    with tempfile.TemporaryDirectory() as directory:
        out = launch(_run, (args.layers, args.width, args.rounds, directory),
                     num_devices=args.world)
    per_rank = {name: statistics.median(t for r in out.values() for t in r[name])
                for name in ("without", "with")}
    lines = [
        "# The preemption vote: what it costs a step",
        "",
        f"Command: `python benchmarks/step_vote.py --world {args.world} --layers {args.layers} "
        f"--width {args.width} --rounds {args.rounds}`",
        "",
        f"{args.layers} linear layers of {args.width}x{args.width} float32, one FSDP unit each, "
        f"AdamW, batch 8, N = {args.world} virtual devices on {os.cpu_count()} cores; "
        f"{args.rounds} rounds of {STEPS} steps of each loop, alternating; medians over every "
        f"rank's steps.",
        "",
        "| loop | step (median) |",
        "| --- | --- |",
        f"| without a manager | {per_rank['without'] * 1e3:.1f} ms |",
        f"| `maybe_save` at every step (votes, never saves) | {per_rank['with'] * 1e3:.1f} ms |",
        "",
        f"Difference: {(per_rank['with'] - per_rank['without']) * 1e3:+.1f} ms per step "
        f"({per_rank['with'] / per_rank['without']:.2f}x).",
    ]
    write_result(args.out, lines)


if __name__ == "__main__":
    main()
