import pickle, re, sys, collections
sys.path.insert(0, sys.argv[1])
from xla_fsdp.aot.step_time import Schedule
from xla_fsdp.aot.topology import resolve
sys.path.insert(0, "benchmarks/results/tpu_plan/hbm_breakdown")
from breakdown import category
topo = resolve("v5e-8")
impl, want = sys.argv[2], sys.argv[3]
opt, _ = pickle.load(open(f"benchmarks/results/tpu_plan/hbm_breakdown/{impl}.pkl", "rb"))
s = Schedule(opt[0], topo)
c = collections.Counter(); ex = {}
for ins in s.computations.get(s.entry, []):
    k, src = category(ins, s.computations)
    if k != want: continue
    b = s.costs.of(ins, s.entry).hbm_bytes
    key = (src, re.sub(r"\{[^}]*\}", "", ins.shape)[:80])
    c[key] += b; ex.setdefault(key, ins)
for key, b in c.most_common(12):
    print(f"{b/2**30:6.2f} GiB", key, "n=", sum(1 for i in s.computations[s.entry] if category(i, s.computations)[0]==want and (category(i, s.computations)[1], re.sub(r'\{[^}]*\}', '', i.shape)[:80])==key))
