"""The README's first command, shrunk: train, checkpoint, consolidate, re-evaluate in plain
PyTorch, then resume on another device count (which reshards the checkpoint)."""
import csv
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "8",
         "--log-every", "2", "--checkpoint-every", "4", "--eval-batches", "2"]


def _run(out, *args):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_lm.py"),
                           "--out", str(out), *SMALL, *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


def _eval_losses(stdout):
    match = re.search(r"eval loss: sharded on XLA ([\d.]+), consolidated in plain PyTorch "
                      r"([\d.]+)", stdout)
    assert match, stdout
    return float(match.group(1)), float(match.group(2))


@pytest.mark.slow
def test_train_consolidate_resume_elsewhere(tmp_path):
    out = _run(tmp_path, "--steps", "8", "--devices", "4")
    sharded, plain = _eval_losses(out)
    assert abs(sharded - plain) <= 1e-4
    assert os.path.exists(tmp_path / "ckpt" / "step000008_rank-00000003-of-00000004.pth")
    with open(tmp_path / "loss.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 2, 4, 6, 7]
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])  # it learns, even in 8 steps
    with open(tmp_path / "loss.png", "rb") as f:  # what the README's first command shows
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    out = _run(tmp_path, "--steps", "12", "--devices", "2", "--resume")
    sharded, plain = _eval_losses(out)
    assert abs(sharded - plain) <= 1e-4
    assert os.path.exists(tmp_path / "ckpt" / "step000008_as2_rank-00000001-of-00000002.pth")
    with open(tmp_path / "loss.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == [0, 2, 4, 6, 7, 8, 10, 11]  # the history continued from the checkpoint
