"""JAX reference: an AdamW update whose two moments live in TPU host memory (pinned_host), compiled
by libtpu for a v5e chip that is not here, against the same update with everything in HBM.

Run with the TPU compiler's interpreter (Python 3.12 + jax[tpu]; `python -m xla_fsdp.aot install`
creates it):
  ~/.cache/xla_fsdp/tpu-compiler/bin/python jax_reference.py OUT_DIR N K [K ...]
N fp32 elements in all, split into K equal tensors (one update each). Prints one JSON line per
(K, variant) with libtpu's compiled memory statistics (bytes) or the compiler's refusal, and writes
the lowered StableHLO and the optimized HLO to OUT_DIR. Also prints a probe showing that
peak_memory_in_bytes counts host-memory arguments too (so HBM = total_allocation_bytes).
"""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

out_dir, N, Ks = sys.argv[1], int(sys.argv[2]), [int(k) for k in sys.argv[3:]] or [1]
os.makedirs(out_dir, exist_ok=True)
topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
mesh = Mesh(np.array(topo.devices[:1]), ("x",))
dev = NamedSharding(mesh, P())
host = NamedSharding(mesh, P(), memory_kind="pinned_host")
D, H = jax.memory.Space.Device, jax.memory.Space.Host
FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "peak_memory_in_bytes", "total_allocation_bytes",
          "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_alias_size_in_bytes",
          "host_temp_size_in_bytes")


def adamw(p, g, m, v, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, step=1.0):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p * (1 - lr * wd) - lr * (m / (1 - b1 ** step)) / (jnp.sqrt(v / (1 - b2 ** step)) + eps)
    return p, m, v


def all_device(ps, gs, ms, vs):
    return tuple(zip(*[adamw(*a) for a in zip(ps, gs, ms, vs)]))


def moments_pinned_host(ps, gs, ms, vs):
    out = []
    for p, g, m, v in zip(ps, gs, ms, vs):
        p, m, v = adamw(p, g, jax.device_put(m, D), jax.device_put(v, D))
        out.append((p, jax.device_put(m, H), jax.device_put(v, H)))
    return tuple(zip(*out))


def stats(compiled):
    st = compiled.memory_analysis()
    return {k: int(getattr(st, k)) for k in FIELDS}


for K in Ks:
    s = tuple(jax.ShapeDtypeStruct((N // K,), jnp.float32) for _ in range(K))
    for fn, state in ((all_device, dev), (moments_pinned_host, host)):
        name = fn.__name__
        jitted = jax.jit(fn, in_shardings=(dev, dev, state, state), out_shardings=(dev, state, state),
                         donate_argnums=(0, 2, 3))
        lowered = jitted.lower(s, s, s, s)
        tag = f"jax_{name}_N{N}_K{K}"
        open(os.path.join(out_dir, tag + ".stablehlo.mlir"), "w").write(lowered.as_text())
        row = {"source": "jax", "variant": name, "N": N, "K": K}
        try:
            c = lowered.compile()
            row.update(status="ok", **stats(c))
            open(os.path.join(out_dir, tag + ".opt.hlo"), "w").write(c.as_text())
        except Exception as exc:
            row.update(status="error", message=str(exc).split("\nSee ")[0])
        print(json.dumps(row), flush=True)

# peak_memory_in_bytes includes host-memory arguments: an argument left untouched in pinned_host
n = jax.ShapeDtypeStruct((64 * 2 ** 20,), jnp.float32)
probe = jax.jit(lambda x, y: (x, y * 2), in_shardings=(host, dev), out_shardings=(host, dev),
                donate_argnums=(0,)).lower(n, n).compile()
print(json.dumps({"source": "jax", "variant": "probe_untouched_host_arg_256MiB", "status": "ok",
                  **stats(probe)}))
