"""MaxText's published Llama 3.1 8B v6e-8 recipe, compiled here by MaxText's own
``train_compile`` for a v6e-8 with the libtpu the planner uses, so that its scheduled
program can go through the same step-time model as ours (``scripts.bench.tpu_calibration``).

    python -m scripts.bench.maxtext_compile [--out FILE]   # about 25 minutes on 2 cores

The first run makes an environment of its own (``~/.cache/xla_fsdp/maxtext``, Python >=
3.12): ``maxtext[tpu]`` from the package index, then ``jax[tpu]`` at the planner's pin,
which puts back libtpu 0.0.50.1 (maxtext pulls a newer one). MaxText runs unchanged; in its
process only, ``train_compile.jit_and_compile`` is wrapped to keep the compiled executable,
whose ``as_text()`` (the scheduled program, as the planner's own compiles give it) is
written to ``--out``.

The recipe (tpu-recipes ``training/trillium/Llama3.1-8B-MaxText/v6e-8``, workload
``llama3_1_8b_8192_no_collective_matmul`` at MaxText tag ``tpu-recipes-v0.1.4``) with what a
compile needs: 3 x 8,192 tokens per chip, FSDP over the 8 chips, float32 weights, bf16
compute, AdamW, scanned layers, the ``custom`` remat policy offloading the layer input and
the q/k/v/out projections to host memory, splash attention with 2,048 blocks and the fused
backward, its 31 libtpu flags. Two of the flags differ: ``--2a886c8_chip_config_name``, which
this libtpu does not know, is given by its plain name ``--deepsea_chip_config_name`` (a
chip-initialization flag, absent from the compiler's flags), and
``--xla_tpu_enable_async_collective_fusion`` is false, as this libtpu refuses it on v6e.
Run-time settings (the dataset path, the profiler) are left out.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from xla_fsdp.aot.tpu_compiler import JAX_REQUIREMENT, find_base_python

MAXTEXT = "maxtext[tpu]==0.2.5"
VENV = Path(os.environ.get("XLA_FSDP_MAXTEXT_VENV", "~/.cache/xla_fsdp/maxtext")).expanduser()
OUT = os.path.join("benchmarks", "results", "tpu_calibration", "compiled", "maxtext.hlo.txt")
LIBTPU_FLAGS = (
    "--xla_tpu_scoped_vmem_limit_kib=98304 --xla_tpu_use_minor_sharding_for_major_trivial_input=true "
    "--xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1 "
    "--xla_tpu_assign_all_reduce_scatter_layout=true --xla_tpu_enable_data_parallel_all_reduce_opt=true "
    "--xla_tpu_data_parallel_opt_different_sized_ops=true "
    "--xla_tpu_enable_async_collective_fusion=false "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
    "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false "
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true "
    "--xla_tpu_enable_all_reduce_offload_tracing=true --xla_tpu_use_tc_device_shape_on_sc=true "
    "--xla_sc_enable_instruction_fusion=false --xla_sc_disjoint_spmem=false "
    "--xla_sc_disable_megacore_partitioning=true --deepsea_chip_config_name=megachip_tccontrol "
    "--xla_tpu_enable_all_experimental_scheduler_features=true "
    "--xla_tpu_enable_scheduler_memory_pressure_tracking=true "
    "--xla_tpu_host_transfer_overlap_limit=24 --xla_tpu_aggressive_opt_barrier_removal=ENABLED "
    "--xla_lhs_prioritize_async_depth_over_stall=ENABLED --xla_tpu_enable_ag_backward_pipelining=true "
    "--xla_should_allow_loop_variant_parameter_in_chain=ENABLED "
    "--xla_should_add_loop_invariant_op_in_chain=ENABLED --xla_max_concurrent_host_send_recv=100 "
    "--xla_tpu_scheduler_percent_shared_memory_limit=100 --xla_latency_hiding_scheduler_rerun=2 "
    "--xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000")
RECIPE = ("compile_topology=v6e-8 compile_topology_num_slices=1 model_name=llama3.1-8b steps=20 "
          "per_device_batch_size=3 ici_fsdp_parallelism=-1 remat_policy=custom "
          "decoder_layer_input=offload out_proj=offload query_proj=offload key_proj=offload "
          "value_proj=offload max_target_length=8192 attention=flash use_iota_embed=True "
          "dataset_type=synthetic enable_checkpointing=False sa_block_q=2048 sa_block_kv=2048 "
          "sa_block_kv_compute=2048 sa_block_q_dkv=2048 sa_block_kv_dkv=2048 "
          "sa_block_kv_dkv_compute=2048 sa_block_q_dq=2048 sa_block_kv_dq=2048 "
          "sa_use_fused_bwd_kernel=True").split()
# run by the MaxText environment's interpreter: argv = [out, base.yml, key=value...]
_COMPILE = """
import sys
from maxtext.trainers.pre_train import train_compile
kept = {}
compile_step = train_compile.jit_and_compile
def keeping(*args, **kwargs):
    kept["compiled"] = compile_step(*args, **kwargs)
    return kept["compiled"]
train_compile.jit_and_compile = keeping
train_compile.main(["train_compile"] + sys.argv[2:])
with open(sys.argv[1], "w") as f:
    f.write(kept["compiled"].as_text())
"""


def environment() -> Path:
    """The MaxText environment's interpreter, made on first use."""
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([find_base_python(), "-m", "venv", str(VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run(pip + [MAXTEXT], check=True)
        subprocess.run(pip + [JAX_REQUIREMENT], check=True)   # libtpu back at the pin
    return python


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=OUT)
    ns = parser.parse_args(argv)
    python = environment()
    base = subprocess.run([str(python), "-c", "import maxtext, os; print(os.path.dirname("
                           "maxtext.__file__))"], capture_output=True, text=True, check=True)
    config = os.path.join(base.stdout.strip(), "configs", "base.yml")
    work = Path(ns.out).parent
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LIBTPU_INIT_ARGS=LIBTPU_FLAGS, TPU_SKIP_MDS_QUERY="1",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.pop("PYTHONPATH", None)
    env.pop("XLA_FLAGS", None)
    subprocess.run([str(python), "-c", _COMPILE, ns.out, config, "run_name=calibration",
                    f"base_output_directory={work / 'maxtext_run'}"] + RECIPE,
                   env=env, check=True)
    print(f"MaxText's compiled step: {ns.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
