"""``compile_for_tpu`` against libtpu itself: a planned step (one traced rank, nothing
executed, the model on the meta device or not) is the program torch_xla compiles when the
same step runs on virtual devices, and the report says what libtpu says of it.

Needs the TPU compiler (``python -m xla_fsdp.aot install``, which ``.ci/run`` does)."""
import json
import os
import re
import subprocess

import pytest
import torch

from tests.support import tpu_plans
from xla_fsdp.aot import compile_for_tpu, tpu_compiler
from xla_fsdp.aot.plan import trace_step
from xla_fsdp.launch import LaunchError
from ..support.checks import every, nonempty

FIELDS = ("peak_memory_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
          "alias_size_in_bytes", "temp_size_in_bytes")


def _compile(hlos, topology, replicas, partitions=1):
    compiled = tpu_compiler.compile_programs(
        topology, [tpu_compiler.Program(h, replicas, partitions) for h in hlos]).programs
    assert every(c.status == "ok" for c in compiled), [c.message for c in compiled]
    return [({k: c.memory[k] for k in FIELDS}, c.cost["flops"]) for c in compiled]


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["ours", "fsdpv2"])
def test_the_planned_step_is_the_executed_one(workload, tmp_path):
    """Ours at N=4 under ``launch``, FSDPv2 in one SPMD process: the steady step traced
    with no execution (from a model built on the CPU, and on the meta device, whose FSDPv2
    parameters are created on the device and sharded by annotating their graphs) compiles
    to the same memory and FLOPs per chip as the step XLA compiled when it ran. Without the
    donations the traced graph carries, the peak is not the executed one."""
    fn = getattr(tpu_plans, workload)
    executed = tpu_plans.executed_steady_step(workload, "real", str(tmp_path), 4)
    assert len(executed) == 1, "one program compiled in the steady step"
    planned = [trace_step(fn, (build,), 4) for build in ("real", "meta")]
    for traced in nonempty(planned, "planned steps"):
        assert traced.repeated and len(traced.graphs) == 1 and traced.graphs[0].untracked == 0
        assert traced.spmd == (workload == "fsdpv2")
    partitions = 4 if workload == "fsdpv2" else 1
    header, body = planned[1].graphs[0].hlo.split("\n", 1)
    undonated = re.sub(r"buffer_donor=\{.*? \}, ", "", header) + "\n" + body
    results = _compile(executed + [t.graphs[0].hlo for t in planned] + [undonated],
                       "v5e:2x2", 1 if partitions > 1 else 4, partitions)
    assert results[1] == results[0] and results[2] == results[0], results
    assert results[0][0]["alias_size_in_bytes"] > 0     # shards and optimizer state donated
    assert "buffer_donor" not in undonated.split("\n", 1)[0]
    assert results[3][0]["peak_memory_in_bytes"] > results[0][0]["peak_memory_in_bytes"]


@pytest.mark.slow
def test_the_report_says_what_libtpu_says_of_the_same_program(tmp_path):
    report = compile_for_tpu(tpu_plans.ours, "v5e-4", args=("meta",))
    assert report.fits and report.programs == 1 and report.notes == []
    assert report.topology.chips == 4 and report.usable_hbm_bytes == int(15.75 * 2 ** 30)
    path = tmp_path / "step.hlo"
    path.write_text(report.hlo[0])
    direct = subprocess.run(
        [tpu_compiler.compiler_python(), os.path.join(os.path.dirname(tpu_plans.__file__),
                                                      "libtpu_direct.py"),
         str(path), "v5e:2x2", "4"],
        capture_output=True, text=True, timeout=600,
        env={k: v for k, v in dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1",
                                   TPU_SKIP_MDS_QUERY="1").items() if k != "XLA_FLAGS"})
    assert direct.returncode == 0, direct.stderr[-2000:]
    figures = json.loads(direct.stdout.strip().splitlines()[-1])
    assert figures["donors"] > 0
    assert report.peak_bytes == figures["peak"] and report.flops == figures["flops"]
    # FSDP's collectives, each mapped back to the traced program's instruction: the step
    # issues a reduce-scatter per parameter (12 in each of 3 blocks, 3 in the root), which
    # libtpu combines into fewer, no token chaining them (see [Note: no collective token on a
    # TPU]); each block's gathered in forward and again in backward, the root's once (it
    # keeps them), each unit's rank-1 pieces as one all-gather per pass (see [Note: a rank-1
    # gather needs no pinned layout]): 8 in this program
    assert report.hlo[0].count(" reduce-scatter(") == 39
    kinds = report.collective_summary()
    assert set(kinds) == {"all-gather", "reduce-scatter"}
    assert kinds["reduce-scatter"]["count"] < 39 and kinds["all-gather"]["count"] == 8
    assert "TPU plan for v5e-4" in str(report) and "MFU" in str(report)


@pytest.mark.slow
def test_vocabulary_parallel_tables_compile_for_a_tpu_and_are_never_gathered():
    """libtpu compiles the step (torch_xla's pinned all-to-all is XLA's tuple form, which it
    cannot take through StableHLO); no all-gather yields a whole table; the logits go out
    and their gradient comes back in one all-to-all each."""
    import functools
    report = compile_for_tpu(functools.partial(tpu_plans.ours, vocab_parallel=True), "v5e-4",
                             args=("meta",))
    assert report.fits and report.programs == 1
    table = f"[{tpu_plans.VOCAB},{tpu_plans.DIM}]"
    gathers = [line for hlo in report.optimized_hlo for line in hlo.splitlines()
               if re.search(r"= \S+ all-gather(-start)?\(", line)]
    assert gathers and not [g for g in gathers if table in g.split(" all-gather")[0]], gathers
    assert report.collective_summary()["all-to-all"]["count"] == 2


@pytest.mark.slow
def test_a_step_of_two_programs_and_what_a_plan_cannot_do(tmp_path):
    report = compile_for_tpu(tpu_plans.syncs_twice, "v6e-4")
    assert report.programs == 2 and "2 programs" in report.notes[0]
    # GradScaler's step is cut before it reads its flags, in a plan as on the chips
    assert compile_for_tpu(tpu_plans.scaled, "v6e-4").programs == 2
    for how in ("torch.save", "save_sharded"):
        with pytest.raises(LaunchError, match=r"saved a checkpoint \(.*ckpt.*\) before"):
            compile_for_tpu(tpu_plans.reads_and_saves, "v5e-1",
                            args=(str(tmp_path / "ckpt"), how))
    assert list(tmp_path.iterdir()) == []
    unsynced = compile_for_tpu(tpu_plans.never_syncs, "v5e-1")   # what it left pending
    assert "no step repeated" in unsynced.notes[0] and "returned" in unsynced.notes[0]
    assert unsynced.flops > 0
    with pytest.raises(RuntimeError, match="traced no step to compile"):
        compile_for_tpu(tpu_plans.does_nothing, "v5e-1")


@pytest.mark.slow
def test_256_chips_are_planned_by_one_traced_rank_and_spmd_stops_at_64():
    pod = compile_for_tpu(tpu_plans.ours, "v6e-256")
    assert pod.fits and pod.topology.chips == 256 and pod.flops > 0
    # donated per chip: a 256th of the shards and AdamW's two moments (4 bytes each), with
    # every unit's padding to a multiple of 256; a plan for fewer chips would hold more
    elements = sum(p.numel() for p in tpu_plans.GPT().parameters())
    assert 3 * 4 * elements / 256 < pod.alias_bytes < 3 * 4 * (elements / 256 + 256 * 64)
    with pytest.raises(LaunchError, match=r"SPMD step \(FSDPv2\) cannot be planned for 256 "
                                          r"chips.*127 devices.*up to 64"):
        compile_for_tpu(tpu_plans.fsdpv2, "v6e-256")


def test_an_unknown_topology_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="unknown TPU topology 'v4-8'.*v5e-8 / v5e:2x4"):
        compile_for_tpu(tpu_plans.ours, "v4-8")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_no_layer_keeps_its_attention_probabilities_until_backward(dtype):
    """libtpu, given memory to spare, keeps every layer's sdpa probabilities from forward to
    backward (a float32 (batch, heads, seq, seq) buffer per layer, 64 MiB here) unless the
    units' attention computes them again behind a barrier: each layer added then costs its
    activations and shards, a few MiB, not its probabilities."""
    f = tpu_plans.SDPA
    probabilities = f["batch"] * f["heads"] * f["seq"] ** 2 * dtype.itemsize
    temp = [compile_for_tpu(tpu_plans.with_sdpa, "v5e-4", args=(layers, dtype)).temp_bytes
            for layers in (1, 4)]
    assert (temp[1] - temp[0]) / 3 < probabilities / 4, (temp, probabilities)


@pytest.mark.slow
def test_a_step_with_pallas_flash_attention_is_planned_and_its_kernels_costed():
    """torch_xla's flash attention kernels, lowered for the TPU here and compiled by libtpu:
    each kernel carries the analytic cost the step-time model reads (forward 2 matmuls over
    the scores, dq 3, dkv 4, causal halves them), and the model's FLOPs count each attention
    forward once."""
    report = compile_for_tpu(tpu_plans.with_flash_attention, "v6e-4")
    assert report.fits and report.estimate.kernels_without_cost == 0
    kernels = sum(h.count('custom_call_target="tpu_custom_call"') for h in report.optimized_hlo)
    f = tpu_plans.FLASH
    assert kernels == 3 * f["layers"]
    rows = f["batch"] * f["seq"] * f["dim"]                      # tokens x width
    linear = 2 * rows * 4 * f["dim"]                             # qkv and out projections
    scores = 2 * f["batch"] * f["seq"] * f["seq"] * f["dim"] / 2  # one causal matmul
    assert report.model_flops == pytest.approx(3 * f["layers"] * (linear + 2 * scores))
    # what the program runs: each layer's projections forward and their weight gradients,
    # the kernels' matmuls (forward 2, dq 3, dkv 4), and the input gradients of every
    # projection whose input depends on a weight (not the first layer's qkv: its input is
    # the data)
    first_qkv_input_grad = 2 * rows * 3 * f["dim"]
    assert report.estimate.dot_flops == pytest.approx(
        f["layers"] * (3 * linear + 9 * scores) - first_qkv_input_grad)
