"""The ``offload`` setting: the benchmark's GPT (``scripts/bench/model.py``, every block a
unit) trained with xla_fsdp with and without ``offload_optimizer=True``, in float32 and
bf16 compute, beside torch_xla's FSDP (which has no optimizer offload) in the same run;
then this machine's CPU AdamW throughput, and from it an estimate for a v5e-8 host.

    python benchmarks/offload.py [--world 4] [--repeats 3] [--steps 8] [--layers 8] [--dim 512]

Per rank 0, after ``WARM_UP`` steps (medians over those steps, then over fresh processes):

- step time (wall, loss on the host) and its phases: forward (with offload it also makes
  the device copies of the shards the last step changed: ``h2d``), backward (with offload
  it runs the step's program and brings the gradients to the host: ``d2h``, which includes
  waiting for that program to finish), the optimizer step (with offload the host AdamW)
  and the closing ``torch_xla.sync()`` (without offload the step's program runs there;
  with it, rank 0 mostly waits there for the other ranks' host steps). h2d and d2h are
  means over the ranks;
- host time of rank 0's thread, and the executions per step of all ranks;
- memory per rank, counted from the tensors themselves after the last step: on the device,
  every live XLA tensor of rank 0's device (shards or their copies, optimizer state,
  gradients, inputs); on the host, the CPU tensors of the parameters, their gradients and
  the optimizer's state.

On virtual devices "device" memory is host memory too and a transfer is a memcpy: the
transfer times here are no estimate of PCIe. The CPU AdamW throughput (``torch.optim.AdamW``
foreach and fused, 1 and 2 threads) is this machine's; the v5e-8 estimate scales it.

Needs the installed package and the repository root on ``sys.path`` (run from the root).
Writes benchmarks/results/offload/offload.md (``--out`` for another file).
"""
import gc
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import step_parser, write_result  # noqa: E402

WARM_UP = 3
RUNS = (("xla_fsdp", "fp32", False), ("xla_fsdp", "fp32", True),
        ("xla_fsdp", "bf16", False), ("xla_fsdp", "bf16", True),
        ("torch_xla", "bf16", False))
PHASES = ("forward", "backward", "step", "sync", "h2d", "d2h")

# Llama-3.1-8B on a v5e-8 (one host): https://cloud.google.com/tpu/docs/v5e
LLAMA_8B_PARAMS = 8.03e9
V5E_HOST_VCPUS = 224         # ct5lp-hightpu-8t: 224 vCPUs, 384 GB RAM, 2 NUMA nodes, 8 chips
V5E_CHIPS = 8
ASSUMED_PCIE_GBPS = 25.0     # per chip and direction; Google publishes no figure (see note)
ASSUMED_HOST_GBPS = 400.0    # the host's usable memory bandwidth; not published either


class _Timed:
    """Wall time spent in a module function by all ranks of the process (the gradients'
    transfer runs in autograd's thread, not the rank's): ``take()`` gives the time since
    the last call, divided by the number of ranks."""

    def __init__(self, module, name, world):
        self.module, self.name, self.world = module, name, world
        self.spent, self.taken = 0.0, 0.0
        self.lock = threading.Lock()
        self.original = getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                with self.lock:
                    self.spent += time.perf_counter() - start
        setattr(module, name, timed)

    def take(self):
        with self.lock:
            delta, self.taken = self.spent - self.taken, self.spent
        return delta / self.world


def _bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def run_rank(rank, impl, precision, offload, layers, dim, steps):
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met
    from scripts.bench.model import Block, Config, batch, build_model

    cfg = Config(layers=layers, dim=dim, steps=steps)
    device = torch_xla.device()
    options = {"compute_dtype": torch.bfloat16} if precision == "bf16" else {}
    import functools
    if impl == "xla_fsdp":
        from xla_fsdp import FSDP
        from xla_fsdp._xla import trace_only
        from xla_fsdp.wrap import transformer_auto_wrap_policy
        options["offload_optimizer"] = offload
    else:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        options["pin_layout_in_collective_ops"] = False
        trace_only = None
    model = FSDP(build_model(cfg), auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}), **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    timers = {}
    if trace_only is not None and rank == 0:  # the process's functions, patched once
        import torch_xla.runtime as xr
        world = xr.world_size()
        timers = {"h2d": _Timed(trace_only, "to_device", world),
                  "d2h": _Timed(trace_only, "to_host", world)}

    def execute():
        data = met.metric_data("ExecuteTime")
        return data[0] if data else 0

    out = {k: [] for k in ("wall", "host", "executions", "losses") + PHASES}
    try:
        for step in range(steps):
            x, y = (t.to(device) for t in batch(cfg, rank, step))
            count, start, cpu = execute(), time.perf_counter(), time.thread_time()
            for timer in timers.values():
                timer.take()
            marks = [time.perf_counter()]
            optimizer.zero_grad(set_to_none=True)
            loss = model(x, y)
            marks.append(time.perf_counter())
            loss.backward()
            marks.append(time.perf_counter())
            optimizer.step()
            marks.append(time.perf_counter())
            torch_xla.sync()
            marks.append(time.perf_counter())
            out["losses"].append(loss.item())
            out["host"].append(time.thread_time() - cpu)
            out["wall"].append(time.perf_counter() - start)
            out["executions"].append(execute() - count)
            for name, a, b in zip(PHASES, marks, marks[1:]):
                out[name].append(b - a)
            for name in ("h2d", "d2h"):
                out[name].append(timers[name].take() if name in timers else 0.0)
    finally:
        for timer in timers.values():
            setattr(timer.module, timer.name, timer.original)
    torch_xla.sync()
    gc.collect()
    here = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device == device]
    out["device_bytes"] = _bytes(here)
    host = [p for p in model.parameters() if p.device.type == "cpu"]
    host += [p.grad for p in model.parameters() if p.grad is not None and p.grad.device.type == "cpu"]
    host += [v for s in optimizer.state.values() for v in s.values()
             if torch.is_tensor(v) and v.device.type == "cpu"]
    out["host_bytes"] = _bytes(host)
    return out


def measure(impl, precision, offload, args):
    from xla_fsdp import launch
    runs = []
    for _ in range(args.repeats):
        runs.append(launch(run_rank, (impl, precision, offload, args.layers, args.dim,
                                      args.steps), num_devices=args.world)[0])
    return runs


def summary(runs):
    def med(key):
        return statistics.median(statistics.median(r[key][WARM_UP:]) for r in runs)
    out = {k: med(k) for k in ("wall", "host", "executions") + PHASES}
    out["device_mib"] = runs[0]["device_bytes"] / 2 ** 20
    out["host_mib"] = runs[0]["host_bytes"] / 2 ** 20
    out["losses"] = runs[0]["losses"]
    return out


def adamw_throughput(numel, repeats=5):
    """Parameters per second of one CPU AdamW step over ``numel`` float32 parameters in 16
    tensors, foreach and fused, with 1 and 2 threads (medians of ``repeats``)."""
    import torch
    rows = []
    params = [torch.nn.Parameter(torch.randn(numel // 16)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for kind in ("foreach", "fused"):
            opt = torch.optim.AdamW(params, lr=1e-4, **{kind: True})
            opt.step()  # state made
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - start)
            rows.append((kind, threads, numel / statistics.median(times)))
    torch.set_num_threads(os.cpu_count() or 1)
    return rows


def estimate(per_core: float) -> list:
    """The v5e-8 estimate's lines, from this machine's best single-thread AdamW rate."""
    per_chip = LLAMA_8B_PARAMS / V5E_CHIPS
    compute_bound = LLAMA_8B_PARAMS / (per_core * V5E_HOST_VCPUS / 2)
    # AdamW reads the parameter, its gradient and two moments and writes three of them back
    traffic = LLAMA_8B_PARAMS * 4 * 7
    bandwidth = ASSUMED_HOST_GBPS * 1e9
    host_step = max(compute_bound, traffic / bandwidth)
    d2h = per_chip * 2 / (ASSUMED_PCIE_GBPS * 1e9)   # bf16 gradients, as reduced
    h2d = per_chip * 2 / (ASSUMED_PCIE_GBPS * 1e9)   # bf16 copies of the updated shards
    return [
        "", "## Estimate: Llama-3.1-8B, bf16 compute, AdamW offloaded, on a v5e-8 host", "",
        f"- Host: ct5lp-hightpu-8t, {V5E_HOST_VCPUS} vCPUs ({V5E_HOST_VCPUS // 2} physical "
        f"cores), 384 GB RAM, 8 chips (Google's v5e page). It holds all 8 ranks' float32 "
        f"shards, gradients and two moments: 16 B x 8.03e9 = 128 GB.",
        f"- Host AdamW, compute: 8.03e9 parameters at this machine's best single-thread rate "
        f"({per_core / 1e6:.0f} M/s, fused) on {V5E_HOST_VCPUS // 2} cores: "
        f"{compute_bound * 1000:.0f} ms. Memory: the step reads and writes "
        f"{traffic / 1e9:.0f} GB (28 B per parameter); Google publishes neither the host's "
        f"CPU nor its memory bandwidth, so at an assumed {ASSUMED_HOST_GBPS:.0f} GB/s of "
        f"usable bandwidth (two server sockets): {traffic / bandwidth * 1000:.0f} ms. The "
        f"host step is the larger: **{host_step * 1000:.0f} ms**.",
        f"- Transfers per chip and step: the bf16 gradient shard to the host "
        f"({per_chip * 2 / 1e9:.1f} GB) and the bf16 copy of the updated shard back "
        f"({per_chip * 2 / 1e9:.1f} GB). Google publishes no host-chip PCIe figure for v5e; "
        f"at an assumed {ASSUMED_PCIE_GBPS:.0f} GB/s per chip and direction (PCIe 4.0 x16 in "
        f"practice): **{d2h * 1000:.0f} ms** down and **{h2d * 1000:.0f} ms** up, all chips "
        f"at once; scale by {ASSUMED_PCIE_GBPS:.0f} / (real GB/s).",
        f"- Overhead per step, in series: about {(host_step + d2h + h2d) * 1000:.0f} ms. "
        f"Overlapping the transfers with the host step would save at most "
        f"{min(host_step, d2h + h2d) * 1000:.0f} ms of it. The chips idle meanwhile: the "
        f"next forward gathers the updated shards."]


def main():
    ap = step_parser(os.path.join("offload", "offload.md"))
    ap.add_argument("--adamw-numel", type=int, default=32 * 2 ** 20)
    args = ap.parse_args()
    results = {}
    for impl, precision, offload in RUNS:
        results[(impl, precision, offload)] = summary(measure(impl, precision, offload, args))
        print(impl, precision, offload, results[(impl, precision, offload)], flush=True)
    throughput = adamw_throughput(args.adamw_numel)
    lines = [f"# Optimizer offload: the step with and without it (N = {args.world})", "",
             f"`python benchmarks/offload.py --world {args.world} --repeats {args.repeats} "
             f"--steps {args.steps} --layers {args.layers} --dim {args.dim}`; the benchmark's "
             f"GPT, AdamW, medians over steps {WARM_UP + 1}-{args.steps} and {args.repeats} "
             f"fresh processes, rank 0. Phases in ms; memory per rank in MiB, counted from the "
             f"tensors after the last step. Virtual devices: device memory is host memory "
             f"and h2d/d2h are memcpys.", "",
             "| wrapper | compute | offload | step ms | host ms | executions (all ranks) "
             "| forward | (h2d) | backward | (wait + d2h) | optimizer step | sync "
             "| device MiB/rank | host MiB/rank |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (impl, precision, offload), r in results.items():
        ms = {k: 1000 * r[k] for k in ("wall", "host") + PHASES}
        lines.append(
            f"| {impl} | {precision} | {'yes' if offload else 'no'} | {ms['wall']:.1f} | "
            f"{ms['host']:.1f} | {r['executions']:.0f} | {ms['forward']:.1f} | "
            f"{ms['h2d']:.1f} | {ms['backward']:.1f} | {ms['d2h']:.1f} | {ms['step']:.1f} | "
            f"{ms['sync']:.1f} | {r['device_mib']:.1f} | {r['host_mib']:.1f} |")
    lines += ["", "| ratio offload / not | step | host | device MiB |", "| --- | --- | --- | --- |"]
    for precision in ("fp32", "bf16"):
        a, b = results[("xla_fsdp", precision, True)], results[("xla_fsdp", precision, False)]
        lines.append(f"| xla_fsdp {precision} | {a['wall'] / b['wall']:.2f} | "
                     f"{a['host'] / b['host']:.2f} | {a['device_mib'] / b['device_mib']:.2f} |")
    for precision in ("fp32", "bf16"):
        a, b = results[("xla_fsdp", precision, True)], results[("xla_fsdp", precision, False)]
        diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
        lines.append(f"\nLargest loss difference, {precision}, offload against not: {diff:.2e}.")
    lines += ["", f"## CPU AdamW on this machine ({os.cpu_count()} vCPUs), "
              f"{args.adamw_numel / 2 ** 20:.0f} Mi float32 parameters", "",
              "| kernel | threads | M params/s | M params/s per thread |", "| --- | --- | --- | --- |"]
    for kind, threads, rate in throughput:
        lines.append(f"| {kind} | {threads} | {rate / 1e6:.0f} | {rate / threads / 1e6:.0f} |")
    best = max(rate / threads for kind, threads, rate in throughput if threads == 1)
    lines += estimate(best)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    write_result(args.out, lines)


if __name__ == "__main__":
    main()
