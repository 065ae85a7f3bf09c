import pickle, re, sys, collections
sys.path.insert(0, sys.argv[1])
from xla_fsdp.aot.step_time import Schedule
from xla_fsdp.aot.topology import resolve
sys.path.insert(0, "benchmarks/results/tpu_plan/hbm_breakdown")
from breakdown import category
topo = resolve("v5e-8")
res = {}
for impl in ("xla_fsdp", "fsdpv2"):
    opt, _ = pickle.load(open(f"benchmarks/results/tpu_plan/hbm_breakdown/{impl}.pkl", "rb"))
    s = Schedule(opt[0], topo)
    c = collections.Counter()
    for ins in s.computations.get(s.entry, []):
        c[category(ins, s.computations)[0]] += s.costs.of(ins, s.entry).hbm_bytes
    res[impl] = c
keys = sorted(set(res["xla_fsdp"]) | set(res["fsdpv2"]), key=lambda k: -(res["xla_fsdp"][k] + res["fsdpv2"][k]))
for k in keys[:14]:
    print(f"{k:32s} ours {res['xla_fsdp'][k]/2**30:7.2f}  fsdpv2 {res['fsdpv2'][k]/2**30:7.2f}")
