"""torch.compile on FSDP models (see [Note: FSDP's hooks under torch.compile]).

Every placement trains at N = 1, 2 and 4 as the same FSDP model run eagerly does, step by
step, and as the model trained unsharded on one device does: ``torch.compile(root)``, ``FSDP(torch.compile(block))`` by hand and through auto-wrap
of blocks compiled first, and ``torch.compile`` of an auto-wrapped model; with bf16
compute, activation checkpointing, ``no_sync`` accumulation, the optimizer on the host
(``offload_optimizer``), and on a Hugging Face Llama.
After the warm-up steps neither Dynamo nor XLA compiles anything (a failing guard's reason
is in the assertion message). Placements that cannot work are refused by name, and a
compiled unit's dropout scales as the eager one's.

A compiled model whose units can gather in the traced graph (see [Note: collectives traced
into the compiled graph]) runs four programs per rank and step, and its forward program
hands the backward one shards, not full parameters.
"""
import pytest

from xla_fsdp import launch

from ..support.compiled_workloads import (SETTINGS, WARM_UP, refusals, run_settings,
                                          traced_programs)
from ..support.bounds import loss_problems, parameter_problems, precision
from ..support.checks import every, nonempty
from ..support.models import DIM, HIDDEN

NET = [n for n, (_, _, extra) in SETTINGS.items() if not extra.get("llama")]
LLAMA = [n for n, (_, _, extra) in SETTINGS.items() if extra.get("llama")]


def _reference(name):
    """The eager setting with the same options as ``name``."""
    placement, kwargs, extra = SETTINGS[name]
    (ref,) = [n for n, (p, k, e) in SETTINGS.items() if p == "eager" and k == kwargs and e == extra]
    return ref


_RUNS = {}


def net_runs(world):
    """Every setting at ``world`` ranks, in one launch (made once, when first asked for)."""
    if world not in _RUNS:
        _RUNS[world] = launch(run_settings, (world, NET), num_devices=world)
    return _RUNS[world]


def _unsharded_problems(results, world, name):
    """Against the unsharded run: the full parameters, and the ranks' mean loss (the global
    batch's loss; not under no_sync, whose recorded loss is the second micro-batch's)."""
    ref = results[0]["unsharded"]
    bound = precision(SETTINGS[name][1].get("compute_dtype"))
    problems = []
    if not SETTINGS[name][2].get("no_sync"):
        means = [sum(r[name]["losses"][step] for r in results.values()) / world
                 for step in range(len(ref["losses"]))]
        problems += [f"against unsharded: {p}" for p in
                     loss_problems(means, ref["losses"], bound, "mean loss")]
    return problems + [f"against unsharded: {p}" for p in
                       parameter_problems(results[0][name]["full"], ref["full"], bound)]


def _problems(results, name):
    ref = results[_reference(name)]
    got = results[name]
    bound = precision(SETTINGS[name][1].get("compute_dtype"))
    problems = [f"against eager: {p}" for p in
                loss_problems(got["losses"], ref["losses"], bound)
                + parameter_problems(got["full"], ref["full"], bound)]
    frames, graphs = got["per_step"][0]
    if frames == 0:
        problems.append("Dynamo compiled nothing: the model did not run compiled")
    late = got["per_step"][WARM_UP:]
    if any(step != (0, 0) for step in late):
        problems.append(f"compiled after step {WARM_UP} (Dynamo frames, XLA graphs per step): "
                        f"{got['per_step']}; guard failures: {got['guard_failures']}")
    return problems


@pytest.mark.slow  # a launch per N of every placement; the quick tier keeps the refusals
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", [n for n in NET if SETTINGS[n][0] != "eager"])
def test_compiled_trains_as_eager(world, name):
    runs = net_runs(world)
    for rank, results in nonempty(runs.items(), "ranks"):
        problems = _problems(results, name)
        assert not problems, f"N={world} rank {rank} {name}:\n" + "\n".join(problems)
    problems = _unsharded_problems(runs, world, name)
    assert not problems, f"N={world} {name} against unsharded:\n" + "\n".join(problems)


@pytest.mark.slow
def test_compiled_llama_trains_as_eager():
    runs = launch(run_settings, (2, LLAMA), num_devices=2)
    for name in nonempty((n for n in LLAMA if SETTINGS[n][0] != "eager"), "compiled settings"):
        for rank, results in nonempty(runs.items(), "ranks"):
            problems = _problems(results, name)
            assert not problems, f"rank {rank} {name}:\n" + "\n".join(problems)
        problems = _unsharded_problems(runs, 2, name)
        assert not problems, f"{name} against unsharded:\n" + "\n".join(problems)


# [Note: collectives traced into the compiled graph]: a model whose units all gather in the
# traced graph runs its forward program, the sync of the seed gradient autograd makes for
# backward, its backward program, and the optimizer's step: four per rank, whatever the
# number of units. Placements that run on the graph-break path are not bounded here.
TRACED = ("compile_root", "compile_autowrapped")
TRACED_EXECUTIONS = 4


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_traced_placements_run_four_programs_per_step(world):
    results = net_runs(world)[0]
    traced = [name for name, (placement, kwargs, extra) in SETTINGS.items()
              if placement in TRACED and not kwargs.get("offload_optimizer")
              and not extra.get("no_sync") and not extra.get("llama")]
    for name in nonempty(traced, "settings on the traced path"):
        got = results[name]["executions"]
        assert got <= TRACED_EXECUTIONS, f"N={world} {name}: {got} executions per rank and step"
    assert results["eager"]["executions"] == 1


@pytest.mark.slow
def test_traced_programs_keep_zero3_memory():
    """ZeRO-3 under compile, at N = 4 on the traced path.

    The forward program hands the backward one the blocks' shards and re-gathers them there;
    with ``reshard_after_forward=False`` it hands over the full parameters instead, as that
    setting asks. And libtpu, compiling the backward program for a v5e-4, keeps each unit's
    reduce-scatters its own ([Note: one unit's reductions before the next unit's backward]),
    instead of merging every unit's into all-reductions at the end of the program, which
    would keep all the full gradients until then."""
    from xla_fsdp.aot import tpu_compiler
    from xla_fsdp.aot.topology import resolve
    from xla_fsdp.aot.tpu_schedule import collectives, traced_collectives

    got = launch(traced_programs, (4,), num_devices=4)[0]
    full = {(HIDDEN, DIM), (DIM, HIDDEN)}  # the blocks' linear weights, unsharded
    assert not full & set(got["saved"][True]), got["saved"][True]
    assert full <= set(got["saved"][False]), got["saved"][False]

    slice_ = resolve("v5e-4")
    (compiled,) = tpu_compiler.compile_programs(
        slice_.name, [tpu_compiler.Program(got["backward"], slice_.chips)]).programs
    assert compiled.status == "ok", compiled.message
    found = collectives(compiled.optimized_hlo, slice_.chips,
                        traced_collectives(got["backward"]))
    reductions = [c for c in found if c.kind == "reduce-scatter"]
    # three units take part (the root, two blocks): one reduction each, at least
    assert len(reductions) >= 3, [(c.kind, c.name, c.compiled_as) for c in found]


def test_placements_that_cannot_work_are_refused_by_name():
    out = launch(refusals, num_devices=1)[0]
    assert out["fullgraph_inside_block"] is None, out["fullgraph_inside_block"]
    assert out["fullgraph_traced"] is None, out["fullgraph_traced"]
    assert "FSDP unit around Net" in out["fullgraph"], out["fullgraph"]
    assert "FSDP(torch.compile(module, fullgraph=True))" in out["fullgraph"], out["fullgraph"]
    assert out["scanned"].startswith("RuntimeError: ScannedLayers (3 x Block) cannot run inside "
                                     "torch.compile"), out["scanned"]
    assert "FSDP(torch.compile(layer))" in out["scanned"], out["scanned"]
    assert "torch.compile'd module (Block) to group" in out["group_of_compiled"], \
        out["group_of_compiled"]
    assert out["vocab_parallel"].startswith(
        "RuntimeError: FSDP unit around TiedLM: the vocab_parallel tables ['emb.weight'] "
        "cannot run inside torch.compile"), out["vocab_parallel"]
    # torch_xla's own dropout kernel scaled kept values by 1/p: 2.3 here
    assert every(abs(mean - 1) < 0.05 for mean in out["dropout"]), out["dropout"]
