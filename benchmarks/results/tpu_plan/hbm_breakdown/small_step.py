"""A small Llama 3.2 1B step (v5e-8, LAYERS layers, SEQ tokens per chip, the defaults)
planned from the checkout REPO: `python small_step.py REPO [LAYERS [SEQ [OUT.pkl]]]`."""
import sys
repo = sys.argv[1]
sys.path.insert(0, repo)  # the checkout to plan: main, or a worktree with a patch applied
from scripts.bench.tpu_plan import Setting, train_step
from xla_fsdp.aot import compile_for_tpu
import xla_fsdp
if __name__ == "__main__":
    assert xla_fsdp.__file__.startswith(repo), xla_fsdp.__file__
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    seq = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    r = compile_for_tpu(train_step, "v5e-8", args=(Setting("xla_fsdp", "llama-3.2-1b", layers, seq),))
    e = r.estimate
    print(repo, "peak", round(r.peak_bytes / 2**30, 3), "hbm", round(r.bytes_accessed / 2**30, 3), "step", round(e.seconds, 4),
          {k: (v["count"], v["overlapped"], v["asynchronous"]) for k, v in r.collective_summary().items()}, flush=True)
    if len(sys.argv) > 4:
        import pickle; pickle.dump(r.optimized_hlo, open(sys.argv[4], "wb"))
