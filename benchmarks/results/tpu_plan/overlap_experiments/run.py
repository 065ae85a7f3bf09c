"""Plans one step with the experiments' variables set and prints the estimate's parts:
``python benchmarks/results/tpu_plan/overlap_experiments/run.py SPEC...`` from a tree with
``experiments.patch`` (or ``collective_matmul.patch``) applied. SPEC: ``1b[,VAR...]`` (Llama 3.2 1B, v5e-8) or
``gpt[,VAR...]`` (``scripts.bench.tpu_levers``' GPT, v5e-4); each VAR is set to 1. With
``--by-size`` it also counts the collectives by kind, bytes sent per chip, and what libtpu
did with them."""
import collections
import os
import sys

from scripts.bench import tpu_levers, tpu_plan
from xla_fsdp.aot import compile_for_tpu

VARIABLES = ("BWD_OFF", "PREFETCH", "LAG", "RING_RS", "A2A_RS", "CM_RS", "CM_BIDI", "AR_RS")


def _size(b: float) -> str:
    return "<64K" if b < 2 ** 16 else "<4M" if b < 2 ** 22 else "<64M" if b < 2 ** 26 else ">=64M"

if __name__ == "__main__":
    by_size = "--by-size" in sys.argv
    for spec in [a for a in sys.argv[1:] if a != "--by-size"]:
        model, *names = spec.split(",")
        for name in VARIABLES:
            os.environ.pop(name, None)
        os.environ.update({name: "1" for name in names})
        if model == "1b":
            r = compile_for_tpu(tpu_plan.train_step, "v5e-8",
                                args=(tpu_plan.Setting("xla_fsdp", "llama-3.2-1b", 16, 2048),))
        else:
            r = compile_for_tpu(tpu_levers.train_step, "v5e-4", args=("xla_fsdp", {}, {}))
        e, s = r.estimate, r.collective_summary()
        print(spec, f"peak {r.peak_bytes / 2 ** 20:.1f} MiB, HBM {r.bytes_accessed / 2 ** 20:.0f} "
              f"MiB, step {e.seconds * 1e3:.3f} ms, busy {e.busy_seconds * 1e3:.3f} ms, waiting "
              f"{e.exposed_collective_seconds * 1e3:.3f} ms, overlapped "
              f"{sum(int(v['overlapped']) for v in s.values())} / "
              f"{sum(int(v['count']) for v in s.values())}", flush=True)
        if by_size:
            rows = collections.Counter()
            for c in r.collectives:
                rows[(c.kind, _size(c.bytes_per_chip), c.compiled_as, c.asynchronous,
                      c.overlapped)] += c.count
            for key, count in sorted(rows.items()):
                print(" ", count, key)
