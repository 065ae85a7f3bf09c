import pickle, sys
sys.path.insert(0, ".")
from scripts.bench.tpu_plan import Setting, train_step
from xla_fsdp.aot import compile_for_tpu
if __name__ == "__main__":
    impl = sys.argv[1]
    r = compile_for_tpu(train_step, "v5e-8", args=(Setting(impl, "llama-3.2-1b", 16, 2048),))
    pickle.dump((r.optimized_hlo, r.hlo), open(f"benchmarks/results/tpu_plan/hbm_breakdown/{impl}.pkl", "wb"))
    print("done", r.bytes_accessed / 2**30)
