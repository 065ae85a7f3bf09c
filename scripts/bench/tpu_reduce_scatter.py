"""Does libtpu run a reduce-scatter asynchronously when JAX issues it? Our gradient
reduce-scatters never run asynchronously on libtpu's schedule; this compares them with
JAX's own ``psum_scatter`` compiled by the same libtpu for the same chips. The compiler's
schedule, not a measurement.

    python -m scripts.bench.tpu_reduce_scatter   # -> benchmarks/results/tpu_plan/reduce_scatter.md

Both sides compile one program of the same shape: three gradient-like matmuls on each
chip's tokens, each reduce-scattered over the chips along dim 0, with independent matmuls
between them that a scheduler could run while a reduce-scatter moves data. Ours is the
instruction torch_xla 2.9 emits (cross-replica, no channel id) as HLO text; JAX's is
``jax.lax.psum_scatter`` under ``shard_map`` (a channel id and global device ids),
compiled by JAX in the compiler's own environment. Each runs at libtpu's defaults and
again with the async-collective flags MaxText sets. Then two lowerings a replica program
could use instead, at the defaults: a ring of collective-permutes, and an all-to-all
followed by a sum.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List, Optional

OUT = os.path.join("benchmarks", "results", "tpu_plan", "reduce_scatter.md")
TOPOLOGY = "v5e:2x2"
CHIPS = 4
TOKENS = 2048   # per chip
SIZES = ((1024, 1024), (2048, 8192))   # the gradient's (rows, columns); 8192: a 1B MLP's
MAXTEXT_FLAGS = ("--xla_tpu_enable_async_collective_fusion=true "
                 "--xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter=true "
                 "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
                 "--xla_tpu_overlap_compute_collective_tc=true")

# Run by the compiler's interpreter: JAX lowers and compiles the same step for the slice
# and prints libtpu's optimized module.
_JAX_PROGRAM = """
import sys, jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
rows, cols, tokens = (int(a) for a in sys.argv[1:4])
devices = topologies.get_topology_desc(platform="tpu", topology_name=sys.argv[4]).devices
mesh = Mesh(devices, ("fsdp",))
def body(x, y, w1, w2, w3):
    out, h = [], y
    for w in (w1, w2, w3):
        out.append(jax.lax.psum_scatter(x.T @ h, "fsdp", scatter_dimension=0, tiled=True))
        h = h @ w
    return (*out, h)
step = jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P("fsdp"), P(), P(), P()),
                     out_specs=P("fsdp"), check_vma=False)
n = len(devices)
shard = NamedSharding(mesh, P("fsdp"))
args = [jax.ShapeDtypeStruct((tokens * n, rows), jnp.float32, sharding=shard),
        jax.ShapeDtypeStruct((tokens * n, cols), jnp.float32, sharding=shard)] + [
        jax.ShapeDtypeStruct((cols, cols), jnp.float32, sharding=NamedSharding(mesh, P()))
        for _ in range(3)]
print(jax.jit(step).lower(*args).compile().as_text())
"""


def _program(name: str, rows: int, cols: int, reduce) -> str:
    """The probe's step as HLO text, each gradient ``g<i>`` reduced by the lines
    ``reduce(i, shard)`` returns, the last of which defines ``rs<i>``."""
    shard = f"f32[{rows // CHIPS},{cols}]"
    lines = [f"HloModule {name}", "",
             "add {", "  a = f32[] parameter(0)", "  b = f32[] parameter(1)",
             "  ROOT s = f32[] add(a, b)", "}", "", "ENTRY main {",
             f"  x = f32[{TOKENS},{rows}] parameter(0)", f"  h0 = f32[{TOKENS},{cols}] parameter(1)",
             "  id = u32[] replica-id()", "  r = s32[] convert(id)", f"  n = s32[] constant({CHIPS})",
             "  z = s32[] constant(0)", "  zero = f32[] constant(0)"]
    for i in (1, 2, 3):
        lines += [
            f"  w{i} = f32[{cols},{cols}] parameter({i + 1})",
            f"  g{i} = f32[{rows},{cols}] dot(x, h{i - 1}), lhs_contracting_dims={{0}}, "
            f"rhs_contracting_dims={{0}}"]
        lines += reduce(i, shard)
        lines.append(f"  h{i} = f32[{TOKENS},{cols}] dot(h{i - 1}, w{i}), lhs_contracting_dims={{1}}, "
                     f"rhs_contracting_dims={{0}}")
    lines += [f"  ROOT t = ({shard}, {shard}, {shard}, f32[{TOKENS},{cols}]) "
              f"tuple(rs1, rs2, rs3, h3)", "}"]
    return "\n".join(lines) + "\n"


def ours(rows: int, cols: int) -> str:
    """The step, its reduce-scatters as torch_xla 2.9 lowers ours."""
    return _program("reduce_scatter_probe", rows, cols, lambda i, shard: [
        f"  rs{i} = {shard} reduce-scatter(g{i}), replica_groups={{}}, dimensions={{0}}, "
        f"to_apply=add"])


def ring(rows: int, cols: int) -> str:
    """The step, each reduce-scatter a ring of ``CHIPS - 1`` collective-permutes: at step
    ``s`` a chip adds its block ``(rank - 1 - s) mod CHIPS`` to what its neighbour sent."""
    block = rows // CHIPS
    pairs = ",".join("{%d,%d}" % (c, (c + 1) % CHIPS) for c in range(CHIPS))

    def reduce(i: int, shard: str) -> List[str]:
        out = [f"  v{i} = f32[{CHIPS},{block},{cols}] reshape(g{i})"]
        for step in range(CHIPS):
            out += [f"  o{i}_{step} = s32[] constant({CHIPS - 1 - step})",
                    f"  e{i}_{step} = s32[] add(r, o{i}_{step})",
                    f"  k{i}_{step} = s32[] remainder(e{i}_{step}, n)",
                    f"  d{i}_{step} = f32[1,{block},{cols}] dynamic-slice(v{i}, k{i}_{step}, z, z), "
                    f"dynamic_slice_sizes={{1,{block},{cols}}}",
                    f"  b{i}_{step} = {shard} reshape(d{i}_{step})"]
        acc = f"b{i}_0"
        for step in range(1, CHIPS):
            out += [f"  p{i}_{step} = {shard} collective-permute({acc}), "
                    f"source_target_pairs={{{pairs}}}",
                    f"  {'rs' + str(i) if step == CHIPS - 1 else f'a{i}_{step}'} = {shard} "
                    f"add(p{i}_{step}, b{i}_{step})"]
            acc = f"a{i}_{step}"
        return out
    return _program("ring_probe", rows, cols, reduce)


def all_to_all(rows: int, cols: int) -> str:
    """The step, each reduce-scatter an all-to-all of the gradient's blocks followed by the
    sum of the blocks each chip received."""
    group = ",".join(str(c) for c in range(CHIPS))
    return _program("all_to_all_probe", rows, cols, lambda i, shard: [
        f"  m{i} = f32[{rows},{cols}] all-to-all(g{i}), dimensions={{0}}, "
        f"replica_groups={{{{{group}}}}}",
        f"  v{i} = f32[{CHIPS},{rows // CHIPS},{cols}] reshape(m{i})",
        f"  rs{i} = {shard} reduce(v{i}, zero), dimensions={{0}}, to_apply=add"])


def _with_flags(flags: Optional[str]) -> Dict[str, str]:
    env = dict(os.environ)
    if flags:
        env["LIBTPU_INIT_ARGS"] = flags
    return env


def jax_optimized(rows: int, cols: int, flags: Optional[str]) -> str:
    from xla_fsdp.aot.tpu_compiler import compiler_python
    done = subprocess.run([compiler_python(), "-c", _JAX_PROGRAM, str(rows), str(cols),
                           str(TOKENS), TOPOLOGY], capture_output=True, text=True,
                          env=_with_flags(flags), timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"JAX's compile failed: {done.stderr[-2000:]}")
    return done.stdout


def compiled_for_tpu(hlo_text: str, flags: Optional[str] = None):
    """libtpu's ``Compiled`` for one of the probe's programs."""
    from xla_fsdp.aot.tpu_compiler import Program, compile_programs
    saved = os.environ.get("LIBTPU_INIT_ARGS")
    os.environ.update(_with_flags(flags))   # the compiler process inherits it
    try:
        (compiled,) = compile_programs(TOPOLOGY, [Program(hlo_text, CHIPS)]).programs
    finally:
        if saved is None:
            os.environ.pop("LIBTPU_INIT_ARGS", None)
        else:
            os.environ["LIBTPU_INIT_ARGS"] = saved
    if compiled.status != "ok":
        raise RuntimeError(f"libtpu refused the program: {compiled.message[:2000]}")
    return compiled


def describe(optimized_hlo: str) -> str:
    """What the schedule made of the gradient reductions, e.g. '3 reduce-scatter (sync)'."""
    from xla_fsdp.aot.tpu_schedule import collectives
    seen: Dict[str, int] = {}
    for c in collectives(optimized_hlo, CHIPS):
        how = ("async" if c.asynchronous else "sync") + (", overlapped" if c.overlapped else "")
        key = f"{c.compiled_as} ({how})"
        seen[key] = seen.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(seen.items())) or "none"


def main(argv: Optional[List[str]] = None) -> None:
    from .report import publish
    lines = ["# Reduce-scatters on libtpu's schedule: ours and JAX's", "",
             f"`python -m scripts.bench.tpu_reduce_scatter`: three gradient matmuls of "
             f"{TOKENS} tokens per chip, each reduce-scattered over the {CHIPS} chips of a "
             f"{TOPOLOGY}, with independent matmuls between them; what libtpu scheduled. "
             "The compiler's schedule, not a measurement. 'overlapped': compute runs "
             "inside the collective's fusion or between its start and done.", "",
             "| gradient | flags | ours (torch_xla's reduce-scatter) | JAX's psum_scatter |",
             "|---|---|---|---|"]
    for rows, cols in SIZES:
        for label, flags in (("defaults", None), ("MaxText's async flags", MAXTEXT_FLAGS)):
            row = (f"{rows}x{cols} f32", label,
                   describe(compiled_for_tpu(ours(rows, cols), flags).optimized_hlo),
                   describe(jax_optimized(rows, cols, flags)))
            print(json.dumps(row), flush=True)
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "The same reductions written two other ways, at libtpu's defaults: a ring of "
              f"{CHIPS - 1} collective-permutes (each chip adds its block to its neighbour's "
              "partial sum), and an all-to-all of the gradient's blocks then a sum of the "
              "blocks each chip received. Estimated step: the planner's step-time model "
              "(`xla_fsdp.aot.step_time`); HBM: libtpu's cost analysis.", "",
              "| gradient | lowering | schedule | estimated step | HBM accessed |",
              "|---|---|---|---|---|"]
    from xla_fsdp.aot.step_time import estimate
    from xla_fsdp.aot.topology import resolve
    for rows, cols in SIZES:
        for label, program in (("reduce-scatter (ours)", ours), ("ring of permutes", ring),
                               ("all-to-all + sum", all_to_all)):
            compiled = compiled_for_tpu(program(rows, cols))
            seconds = estimate(compiled.optimized_hlo, resolve(TOPOLOGY)).seconds
            row = (f"{rows}x{cols} f32", label, describe(compiled.optimized_hlo),
                   f"{seconds * 1e6:.0f} us",
                   f"{compiled.cost.get('bytes accessed', 0) / 2 ** 20:.0f} MiB")
            print(json.dumps(row), flush=True)
            lines.append("| " + " | ".join(row) + " |")
    publish(lines, OUT)


if __name__ == "__main__":
    main(sys.argv[1:])
