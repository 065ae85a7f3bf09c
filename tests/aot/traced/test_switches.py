"""The planner's switches reach every kind of unit: a model's wrapper and its scanned stack
both compute in bf16 and are counted. Run in a process of its own, since ``apply`` patches
the unit classes for the rest of the process."""
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json
import torch, torch.nn as nn
from xla_fsdp.aot.traced.switches import Switches, apply
seen = apply(Switches(bf16_compute=True, offload_optimizer=True))
from xla_fsdp import FSDP, ScannedLayers

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

model = Model()
model.layers = ScannedLayers(model.layers)
model = FSDP(model)
print(json.dumps([seen.units, str(model.compute_dtype), str(model.layers.compute_dtype),
                  model.options.offload_optimizer, model.layers.options.offload_optimizer]))
"""


def test_switches_reach_the_wrapper_and_a_scanned_stack():
    env = dict(os.environ, PJRT_DEVICE="CPU")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, cwd=Path(__file__).resolve().parents[3], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    units, root_dtype, stack_dtype, root_offload, stack_offload = json.loads(
        out.stdout.strip().splitlines()[-1])
    assert units == 2
    assert root_dtype == stack_dtype == "torch.bfloat16"
    assert root_offload and stack_offload
