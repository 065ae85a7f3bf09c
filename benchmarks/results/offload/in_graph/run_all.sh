#!/usr/bin/env bash
# Reruns every figure in ../in_graph.md.  Needs: the system python with torch_xla 2.9 (PJRT_DEVICE=CPU,
# nothing runs on a TPU) and the TPU compiler's interpreter (`python -m xla_fsdp.aot install`).
#   bash run_all.sh [WORK_DIR]        -> WORK_DIR/results.jsonl (+ HLO/StableHLO files in WORK_DIR)
# About 3 minutes on 2 cores; peak memory about 1.5 GB (placeholders: nothing of size N is allocated).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-/tmp/in_graph_work}"
TPU_PY="${XLA_FSDP_TPU_PYTHON:-$HOME/.cache/xla_fsdp/tpu-compiler/bin/python}"
SYS_PY="${SYS_PY:-python}"
mkdir -p "$WORK"; OUT="$WORK/results.jsonl"; : > "$OUT"
M64=$((64 * 1024 * 1024)); G1=$((1024 * 1024 * 1024)); G175=$((7 * G1 / 4))
keep() { grep '^{' | tee -a "$OUT"; }

# 1. JAX reference (moments in pinned_host vs all in HBM), libtpu v5e
"$TPU_PY" "$HERE/jax_reference.py" "$WORK" "$M64" 1 8 32 2>/dev/null | keep
"$TPU_PY" "$HERE/jax_reference.py" "$WORK" "$G1" 32 2>/dev/null | keep
"$TPU_PY" "$HERE/jax_reference.py" "$WORK" "$G175" 64 2>/dev/null | keep

# 2. torch_xla 2.9 traces (placeholders), then libtpu on them as traced and with memory kinds added
PJRT_DEVICE=CPU "$SYS_PY" "$HERE/tx_trace.py" "$WORK/m64" "$M64" 1 8 32 2>/dev/null
PJRT_DEVICE=CPU VARIANTS=all_device,offload_ops "$SYS_PY" "$HERE/tx_trace.py" "$WORK/g1" "$G1" 32 2>/dev/null
c() { "$TPU_PY" "$HERE/compile_tpu.py" "$@" 2>/dev/null | keep; }
for K in 1 8 32; do
  c "$WORK/m64/torch_xla_all_device_K$K.stablehlo.mlir" --donate
  c "$WORK/m64/torch_xla_offload_ops_K$K.stablehlo.mlir" --donate
  c "$WORK/m64/torch_xla_offload_ops_K$K.hlo" --donate                 # HLO text route, same verdict
  c "$WORK/m64/torch_xla_offload_ops_K$K.stablehlo.mlir" --donate --host-results
  c "$WORK/m64/torch_xla_offload_ops_K$K.stablehlo.mlir" --donate --host-args --host-results
done
c "$WORK/m64/torch_xla_inbound_only_K8.stablehlo.mlir" --donate
c "$WORK/m64/torch_xla_roundtrip_K8.stablehlo.mlir" --donate
c "$WORK/g1/torch_xla_all_device_K32.stablehlo.mlir" --donate
c "$WORK/g1/torch_xla_offload_ops_K32.stablehlo.mlir" --donate
c "$WORK/g1/torch_xla_offload_ops_K32.stablehlo.mlir" --donate --host-args --host-results

# 3. torch_xla runtime: bindings, executing place_to_host, _run_stablehlo with memory kinds
"$TPU_PY" "$HERE/make_bytecode.py" "$HERE/kinds_probe.mlir" "$WORK/kinds_probe.bc" >/dev/null 2>&1
c "$HERE/kinds_probe.mlir"                                          # the same module, straight to libtpu
mkdir -p "$WORK/probes"; cp "$WORK/kinds_probe.bc" "$WORK/probes/"
PJRT_DEVICE=CPU "$SYS_PY" "$HERE/tx_runtime_probes.py" "$WORK/probes" 2>/dev/null | keep || true
# the HLO torch_xla compiled for that module (kinds dropped), handed to libtpu
for f in $(grep -l annotate_device_placement "$WORK"/probes/xla_dump/*before_optimizations.txt); do
  cp "$f" "$WORK/run_stablehlo_as_compiled.hlo"; c "$WORK/run_stablehlo_as_compiled.hlo" --out-hlo "$WORK/run_stablehlo_as_compiled.opt.hlo"
done
echo "wrote $OUT"
