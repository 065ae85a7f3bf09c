import pickle, sys
sys.path.insert(0, ".")
from scripts.bench.tpu_plan import Setting, train_step
from xla_fsdp.aot import compile_for_tpu
if __name__ == "__main__":
    r = compile_for_tpu(train_step, "v5e-8", args=(Setting("xla_fsdp", "llama-3.2-1b", 16, 2048),))
    pickle.dump((r.optimized_hlo, r.hlo), open("benchmarks/results/tpu_plan/hbm_breakdown/xla_fsdp_tok.pkl", "wb"))
    e = r.estimate
    print("peak", r.peak_bytes / 2**30, "hbm", r.bytes_accessed / 2**30, "step", e.seconds, "busy", e.busy_seconds, "exposed", e.exposed_collective_seconds, {k: (v["count"], v["overlapped"], v["asynchronous"]) for k, v in r.collective_summary().items()}, flush=True)
