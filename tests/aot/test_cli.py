"""``python -m xla_fsdp.aot``: an unchanged script's launch planned instead of run."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "tpu_plan_script.py")


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "xla_fsdp.aot", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def test_a_script_is_planned_for_the_slice_and_ends_at_its_launch(tmp_path):
    out_json = tmp_path / "plan.json"
    done = _cli("--topology", "v5e:2x4", "--json", str(out_json), SCRIPT, "--dim", "256")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TPU plan for v5e-8 (v5e:2x4, 8 chips): fits" in done.stdout
    assert "final loss" not in done.stdout           # what needs a run's results never runs
    report = json.loads(out_json.read_text())
    assert report["fits"] and report["topology"]["chips"] == 8 and report["peak_bytes"] > 0
    assert report["collective_summary"]["all-gather"]["count"] > 0
    assert report["roofline"]["step_seconds"] > 0
    assert any("read" in n and "zeros" in n for n in report["notes"])   # loss.item()


@pytest.mark.slow
def test_what_cannot_be_planned_is_said():
    done = _cli("--topology", "v5e-8", SCRIPT, "--no-launch")
    assert done.returncode == 2 and "ended without calling launch()" in done.stderr
    done = _cli("--topology", "v9-8", SCRIPT)
    assert done.returncode == 2 and "unknown TPU topology 'v9-8'" in done.stderr
    done = _cli("topologies")
    assert done.returncode == 0 and "v6e-256 / v6e:16x16" in done.stdout
