"""HBM bytes of libtpu's scheduled step by what the instruction is, ours against FSDPv2."""
import collections, pickle, re, sys
sys.path.insert(0, ".")
from scripts.bench.tpu_plan import Setting, train_step
from xla_fsdp.aot import compile_for_tpu
from xla_fsdp.aot.step_time import Schedule

def category(ins, comps):
    op = ins.op_name or ""
    # the aten op that made it, without the instance suffixes
    src = re.sub(r"\.\d+", "", op.split("/")[-1])[:40]
    kind = ins.opcode
    if kind == "fusion":
        m = re.search(r"kind=(k\w+)", ins.text)
        kind = "fusion:" + (m.group(1) if m else "?")
        body = " ".join(i.opcode for c in ins.callees for i in comps.get(c, []))
        for tag in ("dot", "convolution", "all-gather", "reduce-scatter", "all-reduce", "reduce", "transpose", "copy", "dynamic-update-slice", "scatter", "gather"):
            if re.search(rf"\b{tag}\b", body):
                kind += "+" + tag
                break
    return kind, src

if __name__ == "__main__":
    out = {}
    for impl in sys.argv[1:]:
        r = compile_for_tpu(train_step, "v5e-8", args=(Setting(impl, "llama-3.2-1b", 16, 2048),))
        by_kind = collections.Counter(); by_src = collections.Counter()
        for hlo in r.optimized_hlo:
            s = Schedule(hlo, r.topology)
            def walk(comp, times=1.0):
                for ins in s.computations.get(comp, []):
                    if ins.opcode == "while":
                        m = re.search(r'known_trip_count.*?"n":"(\d+)"', ins.text)
                        n = int(m.group(1)) if m else 1
                        for c in ins.callees:
                            walk(c, times * n)
                        continue
                    w = s.costs.of(ins, comp)
                    k, src = category(ins, s.computations)
                    by_kind[k] += w.hbm_bytes * times
                    by_src[(k, src)] += w.hbm_bytes * times
            walk(s.entry)
        out[impl] = (r.bytes_accessed, by_kind, by_src)
        print(impl, "bytes_accessed", r.bytes_accessed / 2**30, "modelled", sum(by_kind.values()) / 2**30, flush=True)
        for k, v in by_kind.most_common(20):
            print(f"  {v/2**30:8.2f} {k}")
        for k, v in by_src.most_common(40):
            print(f"  {v/2**30:8.2f} {k}")
    pickle.dump(out, open("benchmarks/results/tpu_plan/hbm_breakdown/out.pkl", "wb"))
