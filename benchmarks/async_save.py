"""What a checkpoint costs the training loop: the time it is blocked per save, the time of the
steps that run while a write is in flight, and the host memory the save adds, per rank, for
asynchronous saves (``save_sharded`` and ``save_dcp`` with ``async_save=True``) against
the synchronous ones and torch_xla's recipe (``xm.save`` on every rank), in the same run.

    python benchmarks/async_save.py [--gb 1.0] [--world 4] [--repeats 3]

The model and optimizer are ``save_memory.py``'s (``--gb`` of float32 linear layers, one FSDP
unit each, AdamW), at N = ``--world`` virtual devices. A step is a forward, backward and
AdamW step on a batch of 2, waited for (``loss.item()``), so that its time is the device's
work and not only its dispatch. For each saver in turn: three steps (their median is the
normal step), then the save; an asynchronous save's steps then go on until every rank's
write is over (asked after each step, outside its timing), then ``wait()`` publishes it.
Blocked time = the save call until every rank has returned from it (the next step's first
collective waits for the last), plus ``wait()``; rank 0's own call is given too. The ranks
of one process take turns at their host work between collectives (the virtual launcher's
turn ring), so on virtual devices the ranks' copies to the host follow one another; on a
TPU or Trainium host each rank's process copies its own at the same time. The memory a
save adds is the peak resident set over the save (and the steps beside it, less what the
three steps before it added on their own) less the resident set before it, over all N
ranks, divided by N (every rank is a thread of this process).

Writes benchmarks/results/async_save.md (``--out`` for another file).
"""
import os
import statistics
import time

from common import (WIDTH, empty_directory, launch_with_directory, peak_added, reset_peak,
                    size_args, stack_layers, torch_xla_recipe, trained_stack, write_result)


def _savers(directory):
    from xla_fsdp.checkpoint import save_dcp, save_sharded

    def sharded(asynchronous):
        return lambda rank, model, opt, i: save_sharded(
            os.path.join(directory, f"files{i}"), model, opt, async_save=asynchronous)

    def dcp(asynchronous):
        return lambda rank, model, opt, i: save_dcp(
            os.path.join(directory, f"dcp{i}"), model, opt, async_save=asynchronous)

    return {"torch_xla recipe (xm.save per rank)": torch_xla_recipe(directory),
            "save_sharded": sharded(False), "save_sharded, async_save=True": sharded(True),
            "save_dcp": dcp(False), "save_dcp, async_save=True": dcp(True)}


def _step(model, opt):
    import torch
    import torch_xla
    start = time.monotonic()
    opt.zero_grad(set_to_none=True)
    loss = model(torch.ones(2, WIDTH, device=torch_xla.device())).square().mean()
    loss.backward()
    opt.step()
    torch_xla.sync()
    loss.item()
    return time.monotonic() - start


def _measure(rank, model, opt, save, turn):
    import torch_xla.core.xla_model as xm
    from xla_fsdp.checkpoint import PendingSave
    xm.rendezvous("steps")
    before = reset_peak() if rank == 0 else 0
    normal = [_step(model, opt) for _ in range(3)]
    steps_peak = peak_added(before) if rank == 0 else 0
    xm.rendezvous("save")
    before = reset_peak() if rank == 0 else 0
    start = time.monotonic()
    pending = save(rank, model, opt, turn)
    own = time.monotonic() - start
    xm.rendezvous("every rank back")  # the next step waits for the last one anyway
    blocked = time.monotonic() - start
    beside = []
    if isinstance(pending, PendingSave):
        while True:
            beside.append(_step(model, opt))
            written = xm.rendezvous("written?", bytes([pending.written()]))
            if all(w == b"\x01" for w in written):
                break
        start = time.monotonic()
        pending.wait()
        blocked += time.monotonic() - start
        own += time.monotonic() - start
    save_peak = peak_added(before) if rank == 0 else 0
    # the steps beside an asynchronous write take their own memory, as the steps before did
    added = save_peak - (steps_peak if beside else 0)
    return {"normal": statistics.median(normal), "blocked": blocked, "own": own,
            "beside": beside, "added": added}


def _run(rank, layers, repeats, directory):
    import torch_xla.core.xla_model as xm
    model, opt, own = trained_stack(layers)
    items = list(_savers(directory).items())
    results = {}
    for i in range(repeats + 1):  # the first round unrecorded: first-call costs
        for name, save in items[i % len(items):] + items[:i % len(items)]:
            got = _measure(rank, model, opt, save, i)
            xm.rendezvous("measured")
            if rank == 0:
                empty_directory(directory)
                if i > 0:
                    results.setdefault(name, []).append(got)
            xm.rendezvous("cleaned")
    return {"own": own, "results": results}


def main():
    args = size_args("async_save.md")
    layers = stack_layers(args.gb)
    out = launch_with_directory(_run, (layers, args.repeats), args.world)
    own, results = out[0]["own"], out[0]["results"]
    model_bytes = layers * WIDTH * WIDTH * 4
    sync_blocked = statistics.median(r["blocked"] for r in results["save_sharded"])
    lines = [
        "# Checkpoints beside training: what a save costs the loop, per rank",
        "",
        f"Command: `python benchmarks/async_save.py --gb {args.gb} --world {args.world} "
        f"--repeats {args.repeats}`",
        "",
        f"Model: {layers} linear layers of {WIDTH}x{WIDTH} float32 ({model_bytes / 2**30:.2f} "
        f"GiB of parameters), one FSDP unit each, AdamW; N = {args.world} virtual devices on "
        f"{os.cpu_count()} cores. What one rank holds (shards and optimizer state): "
        f"{own / 2**20:,.0f} MiB. Medians of {args.repeats} saves each, in rotating order. "
        f"Blocked: from the save call until every rank is back from it, plus `wait()`; "
        f"rank 0's own call beside it. Steps beside the write: the steps an "
        f"asynchronous save's write overlapped, against the steps just before it.",
        "",
        "| save | blocked per save (every rank back) | / save_sharded's | rank 0's own call | "
        "steps beside the write: count, median / normal step | host memory added per rank "
        "| / what the rank holds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in results.items():
        blocked = statistics.median(r["blocked"] for r in runs)
        ratios = [b / r["normal"] for r in runs for b in r["beside"]]
        beside = (f"{statistics.median(len(r['beside']) for r in runs):.0f}, "
                  f"{statistics.median(ratios):.2f}x" if ratios else "none")
        added = statistics.median(r["added"] for r in runs) / args.world
        rank0 = statistics.median(r["own"] for r in runs)
        lines.append(f"| {name} | {blocked:.2f} s | {blocked / sync_blocked:.2f} | "
                     f"{rank0:.2f} s | {beside} | {added / 2**20:,.0f} MiB | {added / own:.2f} |")
    normal = statistics.median(r["normal"] for runs in results.values() for r in runs)
    lines += ["", f"Normal step (median over all rounds): {normal:.2f} s.", "",
              "Raw (blocked s; steps beside / normal): " + "; ".join(
                  f"{name}: {[round(r['blocked'], 2) for r in runs]}, "
                  f"{[[round(b / r['normal'], 2) for b in r['beside']] for r in runs]}"
                  for name, runs in results.items())]
    write_result(args.out, lines)


if __name__ == "__main__":
    main()
