"""A model larger than this machine, planned: Llama 3.1 8B's shape, built on the meta
device and sharded over 8 chips, fits a v6e-8 (32 GiB per chip) with ZeRO-3's per-chip
state, while the planning process stays under 16 GiB (fp32 weights alone are 32 GB).

What a slice too small is told (libtpu's out-of-memory refusal, with the bytes it needed)
is checked on a model whose answer is known by ``tests/aot/test_alternatives.py``; this
module compiles the 8B once, for the slice it fits, which alone takes minutes."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN = """
import json, resource, sys
from scripts.bench.tpu_plan import Setting, train_step
from xla_fsdp.aot.plan import report_for, trace_step
from xla_fsdp.aot.topology import resolve
setting = Setting("xla_fsdp", "llama-3.1-8b", 32, 1024, steps=3)
r = report_for(trace_step(train_step, (setting,), 8), resolve("v6e-8"))
out = {"fits": r.fits, "peak": r.peak_bytes, "argument": r.argument_bytes,
       "message": r.message}
out["rss"] = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                 resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024
print(json.dumps(out))
"""


@pytest.mark.slow
def test_an_8b_llama_built_on_meta_fits_v6e_8_and_is_planned_in_under_16_gib():
    done = subprocess.run([sys.executable, "-c", PLAN], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["fits"] and 16 * 2 ** 30 < out["peak"] < 31.24 * 2 ** 30, out["message"]
    # the shards and AdamW's two moments of 8.03e9 parameters, split over 8 chips, float32
    assert out["argument"] == pytest.approx(8.03e9 * 12 / 8, rel=0.01)
    assert out["rss"] < 16 * 2 ** 30, out["rss"]
