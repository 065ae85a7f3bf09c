"""Run with the TPU compiler's interpreter: python make_bytecode.py IN.mlir OUT.bc [target]
serialises StableHLO text as a portable artifact (what torch_xla._XLAC._run_stablehlo reads)."""
import sys
from jax._src.lib import _jax
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
with mlir.make_ir_context():
    m = ir.Module.parse(open(sys.argv[1]).read())
    bc = _jax.mlir.serialize_portable_artifact(m.operation.get_asm(), sys.argv[3] if len(sys.argv) > 3 else "1.0.0")
open(sys.argv[2], "wb").write(bc)
print(len(bc))
