"""Real processes, real signals: a training process killed (SIGKILL) while an asynchronous
write is in flight, resumed, then preempted (SIGTERM), then resumed to the end. Every loss
of every run equals, bit for bit, the loss of the same step in the first run, which trained
every step without a restart (its last save never finished)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from xla_fsdp.checkpoint import PREEMPTED_EXIT_CODE
from ...support.checks import nonempty

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
STEPS, EVERY = 12, 4


def _start(directory, *args):
    return subprocess.Popen([sys.executable, "-m", "tests.support.manager_script", directory,
                             "--steps", str(STEPS), "--every", str(EVERY), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _losses(directory):
    path = os.path.join(directory, "losses.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(int(s), float.fromhex(v)) for s, v in (line.split() for line in f if line)]


def _wait_for(predicate, process, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None:
            pytest.fail(f"the process ended ({process.returncode}) before {what}:\n"
                        f"{process.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def _finish(process, timeout=300):
    out, _ = process.communicate(timeout=timeout)
    return process.returncode, out


def _complete(directory):
    root = os.path.join(directory, "ckpt")
    return sorted(int(n[4:]) for n in os.listdir(root)
                  if n.startswith("step") and os.path.exists(os.path.join(root, n, "COMPLETE")))


@pytest.mark.slow
def test_killed_mid_write_then_preempted_then_resumed_exactly(tmp_path):
    directory = str(tmp_path)
    # 1. the write of step 8's save stalls after writing its bytes; training goes on to the
    # end and waits there for the write; the process is killed with the write in flight
    first = _start(directory, "--stall-at", "8")
    _wait_for(lambda: os.path.exists(os.path.join(directory, "stalled"))
              and len(_losses(directory)) == STEPS, first, "the stalled write")
    os.killpg(first.pid, signal.SIGKILL)
    _finish(first)
    reference = dict(_losses(directory))
    assert sorted(reference) == list(range(STEPS))
    assert _complete(directory) == [4]  # step 8's files were written, never published
    step8 = os.path.join(directory, "ckpt", "step000008")
    assert any(".tmp-" in n for n in os.listdir(step8))
    os.remove(os.path.join(directory, "stalled"))

    # 2. restarted: step 8's leftovers go, training resumes from step 4, and a SIGTERM
    # (to the launching process, as a scheduler sends it) saves once more and stops
    second = _start(directory, "--pause", "0.5")
    _wait_for(lambda: len(_losses(directory)) >= STEPS + 3, second, "two steps after resuming")
    first_pid = f"tmp-{first.pid}-"  # the killed run's temporary files are gone
    assert not os.path.isdir(step8) or not any(first_pid in n for n in os.listdir(step8))
    os.kill(second.pid, signal.SIGTERM)
    code, out = _finish(second)
    assert code == PREEMPTED_EXIT_CODE, out[-3000:]
    resumed = _losses(directory)[STEPS:]
    stopped_at = resumed[-1][0] + 1
    assert resumed[0][0] == 4 and stopped_at < STEPS
    assert _complete(directory)[-1] == stopped_at  # saved at the step it stopped

    # 3. resumed from the preemption's checkpoint to the end
    third = _start(directory)
    code, out = _finish(third)
    assert code == 0, out[-3000:]
    assert _losses(directory)[STEPS + len(resumed)][0] == stopped_at
    for step, loss in nonempty(_losses(directory), "logged losses"):
        assert loss == reference[step], (step, loss, reference[step])
    assert _complete(directory)[-1] == STEPS


def test_without_a_manager_sigterm_ends_the_launch_as_before(tmp_path):
    """The launchers install a handler, but only a manager makes SIGTERM a request: without
    one the launching process ends of the signal, as it did before."""
    directory = str(tmp_path)
    process = _start(directory, "--no-manager")
    _wait_for(lambda: os.path.exists(os.path.join(directory, "waiting")), process,
              "the ranks to run")
    process.send_signal(signal.SIGTERM)
    code, out = _finish(process, timeout=60)
    assert code == -signal.SIGTERM, out[-3000:]
