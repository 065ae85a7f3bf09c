"""``python -m xla_fsdp.aot``: an unchanged script's launch planned instead of run; its
training step, even when the script would resume a finished run; and every misuse answered
in one line, before anything is traced."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "tpu_plan_script.py")


def _cli(*args, env=None):
    env = dict(os.environ if env is None else env,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "xla_fsdp.aot", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def _said(done) -> list:
    """What the command said on stderr, torch_xla's import warning aside."""
    return [line for line in done.stderr.splitlines()
            if line.strip() and not line.startswith("WARNING:root:Defaulting to PJRT_DEVICE")]


@pytest.mark.slow
def test_a_finished_runs_directory_still_plans_the_training_step(tmp_path):
    """The script resumes from a CheckpointManager whose last checkpoint is its last step:
    run, it would only evaluate. In a plan checkpoints read as absent, so the plan is its
    training step (backward, reduce-scatters, the optimizer's state among its arguments)."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step000005").mkdir(parents=True)
    (ckpt / "step000005" / "COMPLETE").write_text("")
    out_json = tmp_path / "plan.json"
    done = _cli("--topology", "v5e:2x4", "--json", str(out_json), SCRIPT, "--dim", "256",
                "--ckpt", str(ckpt))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TPU plan for v5e-8 (v5e:2x4, 8 chips): fits" in done.stdout
    assert "final loss" not in done.stdout           # what needs a run's results never runs
    report = json.loads(out_json.read_text())
    assert report["fits"] and report["topology"]["chips"] == 8 and report["peak_bytes"] > 0
    assert report["step_kind"] == "training"
    assert report["collective_summary"]["reduce-scatter"]["count"] > 0
    assert report["step_seconds"] > 0 and 0 < report["mfu"] < 1 and 0 < report["hfu"] < 1
    assert any("read" in n and "zeros" in n for n in report["notes"])   # loss.item()
    assert sorted(os.listdir(ckpt)) == ["step000005"]   # nothing written, nothing removed


@pytest.mark.slow
def test_an_evaluation_is_planned_only_when_asked_for():
    done = _cli("--topology", "v5e-8", SCRIPT, "--eval-only")
    assert done.returncode == 4, done.stderr[-3000:]
    said = _said(done)
    assert "no training step to plan" in said[-1] and "ran no backward pass" in said[-1]
    assert "--step eval" in said[-1] and "Traceback" not in done.stderr
    done = _cli("--topology", "v5e-8", "--step", "eval", SCRIPT, "--eval-only")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(FORWARD ONLY step): fits" in done.stdout


def test_misuse_is_answered_in_one_line_before_anything_is_traced(tmp_path, monkeypatch,
                                                                 capsys):
    """Each of these used to trace for seconds, or end in a traceback."""
    from xla_fsdp.aot.__main__ import main

    def said(args):
        code = main(list(args))
        err = capsys.readouterr().err
        return code, [line for line in err.splitlines() if line.strip()]
    for args, expected in [
        (["--topology", "v5e-8", "--json", "/proc/no/such/dir/p.json", SCRIPT],
         "does not exist"),
        (["--topology", "v5e-8", "--json", str(tmp_path), SCRIPT], "is a directory"),
        (["--topology", "v5e-8", "no_such_script.py"], "no_such_script.py: no such file"),
        (["--topology", "v9-8", SCRIPT], "unknown TPU topology 'v9-8'"),
        (["--topology", "v5e-8", SCRIPT, "--no-launch"], "ended without calling launch()"),
        (["estimate", "--topology", "v5e-8", "missing.hlo"], "missing.hlo: no such file"),
    ]:
        code, lines = said(args)
        assert code == 2 and len(lines) == 1 and expected in lines[0], (args, lines)
    import torch_xla
    assert torch_xla.launch.__module__ == "torch_xla.torch_xla"     # put back
    monkeypatch.delenv("XLA_FSDP_TPU_PYTHON", raising=False)
    monkeypatch.setenv("XLA_FSDP_TPU_VENV", str(tmp_path / "none"))
    from xla_fsdp.aot import tpu_compiler
    monkeypatch.setattr(tpu_compiler, "_has_compiler_here", lambda: False)
    code, lines = said(["--topology", "v5e-8", SCRIPT])
    assert code == 2 and len(lines) == 1, lines
    assert "not installed" in lines[0] and "python -m xla_fsdp.aot install" in lines[0]
    # an interpreter too old for jax is refused before a venv is made
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\necho 3 9\n")
    old.chmod(0o755)
    code, lines = said(["install", "--python", str(old), "--venv", str(tmp_path / "venv")])
    assert code == 2 and len(lines) == 1 and "is Python 3.9" in lines[0], lines
    # one that fails midway leaves nothing half-built
    broken = tmp_path / "python3.12"
    broken.write_text('#!/bin/sh\nif [ "$1" = "-c" ]; then echo 3 12; exit 0; fi\n'
                      'echo "venv: cannot create" >&2; exit 1\n')
    broken.chmod(0o755)
    code, lines = said(["install", "--python", str(broken), "--venv", str(tmp_path / "venv")])
    assert code == 2 and len(lines) == 1 and "venv: cannot create" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["python3.12", "python3.9"]
    assert main(["topologies"]) == 0
    out = capsys.readouterr().out
    assert "v6e-256 / v6e:16x16 (256 chips)" in out
    assert "v5e (also: v5litepod, v5lite)" in out and "v5p-384" in out
