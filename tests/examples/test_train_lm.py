"""The README's first command, shrunk: train with asynchronous checkpoints, be preempted
(SIGTERM), run the same command on another device count (which continues from the
checkpoint the preemption saved), consolidate, re-evaluate in plain PyTorch."""
import csv
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "8",
         "--log-every", "2", "--checkpoint-every", "2", "--eval-batches", "2"]


def _command(out, *args):
    return [sys.executable, os.path.join(ROOT, "examples", "train_lm.py"), "--out", str(out),
            *SMALL, *args]


def _run(out, *args):
    # as a new user runs it: PJRT_DEVICE unset (importing torch_xla here set it in this
    # process), and no warning that the CPU was chosen when the launcher chose it
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    done = subprocess.run(_command(out, *args), capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "Defaulting to PJRT_DEVICE" not in done.stderr, done.stderr[-3000:]
    # not a terminal: progress comes a line at a time, not redrawn with carriage returns
    assert "\r" not in done.stderr and "step " in done.stderr, done.stderr[-3000:]
    return done.stdout


def _eval_losses(stdout):
    match = re.search(r"eval loss: sharded on XLA ([\d.]+), consolidated in plain PyTorch "
                      r"([\d.]+)", stdout)
    assert match, stdout
    return float(match.group(1)), float(match.group(2))


def _complete(ckpt):
    return sorted(int(n[4:]) for n in os.listdir(ckpt)
                  if os.path.exists(os.path.join(ckpt, n, "COMPLETE")))


@pytest.mark.slow
def test_train_preempt_resume_elsewhere_consolidate(tmp_path):
    from xla_fsdp.checkpoint import PREEMPTED_EXIT_CODE
    ckpt = tmp_path / "ckpt"
    # a long run on 4 devices, preempted once its second checkpoint is complete; SIGTERM
    # goes to its whole process group, as `timeout` and schedulers send it
    # (see [Note: the fork server ignores the job's SIGTERM])
    run = subprocess.Popen(_command(tmp_path, "--steps", "400", "--devices", "4",
                                    "--async-save", "--keep-last", "2"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    deadline = time.monotonic() + 300
    while not (ckpt / "step000008" / "COMPLETE").exists():
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint at step 8 in 300 s"
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGTERM)
    out, err = run.communicate(timeout=300)
    assert run.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    before = _complete(ckpt)
    stopped = before[-1]
    assert f"preempted: saved step {stopped}" in err
    assert 8 < stopped < 400 and len(_complete(ckpt)) == 2  # --keep-last 2
    assert os.path.exists(ckpt / f"step{stopped:06d}" / "checkpoint_rank-00000003-of-00000004.pth")

    # the same command on 2 devices continues from there, to the end
    out = _run(tmp_path, "--steps", str(stopped + 4), "--devices", "2", "--async-save",
               "--keep-last", "2")
    sharded, plain = _eval_losses(out)
    assert abs(sharded - plain) <= 1e-4
    assert f"trained steps {stopped} to {stopped + 4} on 2 device(s)" in out
    # once more: nothing left to train, and it says so
    again = _run(tmp_path, "--steps", str(stopped + 4), "--devices", "2")
    assert f"nothing to train: {ckpt} already holds step {stopped + 4}" in again, again
    assert _eval_losses(again) == (sharded, plain)
    saved = {s for s in range(stopped + 1, stopped + 5) if s % 2 == 0} | {stopped + 4}
    assert _complete(ckpt) == sorted(saved | set(before))[-2:]
    with open(tmp_path / "loss.csv") as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    last = stopped + 3  # the history went on from the checkpoint
    assert steps == [s for s in range(last + 1) if s % 2 == 0 or s == last]
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])  # it learns
    with open(tmp_path / "loss.png", "rb") as f:  # what the README's first command shows
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # a damaged checkpoint gets advice about that checkpoint, not about disk space
    last = ckpt / f"step{stopped + 4:06d}" / "checkpoint_rank-00000001-of-00000002.pth"
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) // 2)
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    done = subprocess.run(_command(tmp_path, "--steps", str(stopped + 6), "--devices", "2"),
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode != 0
    assert f"cannot resume from step {stopped + 4}" in done.stderr, done.stderr[-3000:]
    assert "Move its step directory out of" in done.stderr and "free some" not in done.stderr
