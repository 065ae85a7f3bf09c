"""Which reduce-scatter shapes libtpu runs asynchronously, and whether reshaping or joining
gradients gets them there (`scripts.bench.tpu_reduce_scatter`'s probe step). From the repo root:

    TOPO=v5e:2x4 CHIPS=8 PYTHONPATH=. python benchmarks/results/tpu_plan/overlap_experiments/rs_shapes.py 2048x8192x1 2048x8192x4
    TOPO=v5e:2x4 CHIPS=8 PYTHONPATH=. python benchmarks/results/tpu_plan/overlap_experiments/rs_shapes.py joint 2048x8192

ROWSxCOLSxK: the gradient viewed as [ROWS*K, COLS/K] for its reduce-scatter (K=1: as ours).
``joint``: the three gradients separately, as one reduce-scatter of their rank-interleaved
rows, and each viewed with 8192 rows; with libtpu's schedule, HBM MiB and estimated us.
"""
import json, sys, time
from scripts.bench import tpu_reduce_scatter as t

def reshaped(rows, cols, k):
    """ours, but each gradient viewed as [rows*k, cols/k] for its reduce-scatter."""
    r2, c2 = rows * k, cols // k
    shard2 = f"f32[{r2 // t.CHIPS},{c2}]"
    def reduce(i, shard):
        return [f"  q{i} = f32[{r2},{c2}] reshape(g{i})",
                f"  sc{i} = {shard2} reduce-scatter(q{i}), replica_groups={{}}, dimensions={{0}}, to_apply=add",
                f"  rs{i} = {shard} reshape(sc{i})"]
    return t._program("reshaped_probe", rows, cols, reduce)

def joint(rows, cols):
    """The three gradients reduced by one reduce-scatter of their rank-interleaved rows."""
    n, b = t.CHIPS, rows // t.CHIPS
    def reduce(i, shard):
        if i < 3:
            return []
        out = [f"  v{j} = f32[{n},{b},{cols}] reshape(g{j})" for j in (1, 2, 3)]
        out += [f"  cc = f32[{n},{3 * b},{cols}] concatenate(v1, v2, v3), dimensions={{1}}",
                f"  flat = f32[{3 * rows},{cols}] reshape(cc)",
                f"  red = f32[{3 * b},{cols}] reduce-scatter(flat), replica_groups={{}}, dimensions={{0}}, to_apply=add"]
        out += [f"  rs{j} = {shard} slice(red), slice={{[{(j - 1) * b}:{j * b}], [0:{cols}]}}" for j in (1, 2, 3)]
        return out
    return t._program("joint_probe", rows, cols, reduce)


def run_joint(specs):
    from xla_fsdp.aot.step_time import estimate
    from xla_fsdp.aot.topology import resolve
    for spec in specs:
        rows, cols = (int(a) for a in spec.split("x"))
        k = max(1, 8192 // rows)
        for label, prog in (("separate", t.ours(rows, cols)), ("joint", joint(rows, cols)),
                            (f"reshaped x{k}", reshaped(rows, cols, k))):
            c = t.compiled_for_tpu(prog)
            s = estimate(c.optimized_hlo, resolve(t.TOPOLOGY)).seconds
            print(json.dumps([spec, label, t.describe(c.optimized_hlo),
                              round(c.cost.get("bytes accessed", 0) / 2**20), round(s * 1e6)]),
                  flush=True)


if __name__ == "__main__":
    import os
    if os.environ.get("TOPO"):
        t.TOPOLOGY, t.CHIPS = os.environ["TOPO"], int(os.environ["CHIPS"])
    if sys.argv[1] == "joint":
        run_joint(sys.argv[2:]); sys.exit()
    for spec in sys.argv[1:]:
        rows, cols, k = (int(a) for a in spec.split("x"))
        prog = t.ours(rows, cols) if k == 1 else reshaped(rows, cols, k)
        t0 = time.time()
        c = t.compiled_for_tpu(prog)
        print(json.dumps([spec, t.describe(c.optimized_hlo),
                          round(c.cost.get("bytes accessed", 0) / 2**20)]),
              round(time.time() - t0, 1), flush=True)

