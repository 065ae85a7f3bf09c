import pickle, sys
sys.path.insert(0, sys.argv[1])
from xla_fsdp.aot.step_time import Schedule
from xla_fsdp.aot.topology import resolve
topo = resolve("v5e-8")
for impl in sys.argv[2:]:
    opt, _ = pickle.load(open(f"benchmarks/results/tpu_plan/hbm_breakdown/{impl}.pkl", "rb"))
    s = Schedule(opt[0], topo)
    e = s.estimate()
    print(sys.argv[1], impl, f"step {e.seconds*1e3:.1f} busy {e.busy_seconds*1e3:.1f} mem {e.memory_seconds*1e3:.1f} mm {e.matmul_seconds*1e3:.1f} exposed {e.exposed_collective_seconds*1e3:.1f} hbm {e.hbm_bytes/2**30:.1f}")
