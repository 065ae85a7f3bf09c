"""What torch_xla 2.9's runtime (system python, PJRT_DEVICE=CPU) does with host memory, three probes:

  PJRT_DEVICE=CPU python tx_runtime_probes.py WORK_DIR

1. bindings: the torch_xla._XLAC functions whose names mention memory/host/kind/layout/placement
   (is there any call that allocates, transfers or tags a buffer in a PJRT memory space?).
2. execute: a 2-step AdamW-like update with place_to_device on the state read and place_to_host on the
   new state, run for real on the CPU client (the state stays an ordinary XLA tensor).
3. run_stablehlo: torch_xla's own StableHLO entry point (_XLAC._run_stablehlo) given a module whose
   main has mhlo.memory_kind = "pinned_host" on an argument and the result (kinds_probe.bc, made from
   kinds_probe.mlir by make_bytecode.py with the compiler's interpreter); the HLO torch_xla then
   compiles is dumped, and checked for S(5) / memory-space attributes.
Prints one JSON line per probe.
"""
import glob, json, os, sys

work = sys.argv[1] if len(sys.argv) > 1 else "/tmp/in_graph_probes"
os.makedirs(work, exist_ok=True)
here = os.path.dirname(os.path.abspath(__file__))
dump = os.path.join(work, "xla_dump")
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
import torch, torch_xla
from torch_xla.experimental.stablehlo_custom_call import place_to_host, place_to_device

words = ("memory", "host", "kind", "layout", "placement", "offload", "space")
print(json.dumps({"probe": "bindings", "torch_xla": torch_xla.__version__,
                  "names": sorted(a for a in dir(torch_xla._XLAC) if any(w in a.lower() for w in words))}))

dev = torch_xla.device()
p, g, m, v = (torch.randn(1024, device=dev) for _ in range(4))
torch_xla.sync()
row = {"probe": "execute_place_to_host_on_state"}
try:
    for step in range(2):
        md, vd = place_to_device(m), place_to_device(v)
        m2 = 0.9 * md + 0.1 * g
        v2 = 0.999 * vd + 0.001 * g * g
        p.sub_(1e-3 * m2 / (v2.sqrt() + 1e-8))
        m.copy_(place_to_host(m2)); v.copy_(place_to_host(v2))
        torch_xla.sync()
    row.update(status="ok", value=float(p.sum()))
except Exception as exc:
    row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
print(json.dumps(row))

row = {"probe": "run_stablehlo_with_memory_kinds"}
bc_path = os.path.join(work, "kinds_probe.bc")
if not os.path.exists(bc_path):
    bc_path = os.path.join(here, "kinds_probe.bc")
before = set(glob.glob(dump + "/*before_optimizations.txt"))
try:
    out = torch_xla._XLAC._run_stablehlo(open(bc_path, "rb").read(),
                                         [torch.ones(1024, device=dev), torch.ones(1024, device=dev)])
    row.update(status="ok", value=float(out[0].sum()))
except Exception as exc:
    row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
new = sorted(set(glob.glob(dump + "/*before_optimizations.txt")) - before)
for f in new:
    text = open(f).read()
    if "annotate_device_placement" in text:
        row.update(hlo_file=f, header=text.split("\n", 1)[0], has_S5="S(5)" in text,
                   has_memory_space_attrs="memory_spaces" in text)
print(json.dumps(row))
