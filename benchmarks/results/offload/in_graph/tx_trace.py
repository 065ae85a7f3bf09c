"""Trace an AdamW update of K fp32 tensors (N elements in all) in torch_xla 2.9 and write its HLO
text (_get_xla_tensors_hlo) and StableHLO text (xm.get_stablehlo) to OUT_DIR. Nothing executes: the
inputs are buffer-less placeholders (create_placeholder_tensor), so any N fits.

  PJRT_DEVICE=CPU python tx_trace.py OUT_DIR N K [K ...]     (VARIANTS=a,b to pick variants)

variants (the optimizer state m, v is in every case an ordinary torch_xla tensor, i.e. an entry
parameter of the program; torch_xla has no way to say where a parameter lives):
  all_device    plain update;
  offload_ops   place_to_device(m), place_to_device(v) before the update, place_to_host on the
                new m, v (the results): what JAX's device_put(..., Space.Device/Host) emits;
  inbound_only  place_to_device on the state read only;
  roundtrip     the new state is sent to host and back inside the program (activation-offload
                style), results on device.
"""
import os, sys, re, json
os.environ.setdefault("PJRT_DEVICE", "CPU")
import torch, torch_xla, torch_xla.core.xla_model as xm
from torch_xla.core.xla_builder import create_placeholder_tensor
from torch_xla.experimental.stablehlo_custom_call import place_to_host, place_to_device

def adamw(p, g, m, v, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, step=1.0):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p * (1 - lr * wd) - lr * (m / (1 - b1 ** step)) / (torch.sqrt(v / (1 - b2 ** step)) + eps)
    return p, m, v

def trace(variant, N, K, out_dir):
    n = N // K
    ph = lambda: create_placeholder_tensor((n,), torch.float32)
    ps, gs, ms, vs = ([ph() for _ in range(K)] for _ in range(4))
    outs = []
    for p, g, m, v in zip(ps, gs, ms, vs):
        if variant in ("offload_ops", "inbound_only"):
            m, v = place_to_device(m), place_to_device(v)
        p2, m2, v2 = adamw(p, g, m, v)
        if variant == "offload_ops":
            m2, v2 = place_to_host(m2), place_to_host(v2)
        if variant == "roundtrip":  # the new state goes to host and back inside the program
            m2, v2 = place_to_device(place_to_host(m2)), place_to_device(place_to_host(v2))
        outs.append((p2, m2, v2))
    results = [o[0] for o in outs] + [o[1] for o in outs] + [o[2] for o in outs]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(results)
    path = os.path.join(out_dir, f"torch_xla_{variant}_K{K}.hlo")
    open(path, "w").write(hlo)
    sh = xm.get_stablehlo(results)
    open(path.replace(".hlo", ".stablehlo.mlir"), "w").write(sh)
    return path

if __name__ == "__main__":
    out_dir = sys.argv[1]; N = int(sys.argv[2]); Ks = [int(k) for k in sys.argv[3:]]
    os.makedirs(out_dir, exist_ok=True)
    variants = os.environ.get("VARIANTS", "all_device,offload_ops,inbound_only,roundtrip").split(",")
    for K in Ks:
        for variant in variants:
            print(trace(variant, N, K, out_dir))
