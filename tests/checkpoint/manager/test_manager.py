"""Asynchronous saves and CheckpointManager in one launch at N=2: a pending save holds the
state of its call while training goes on; the next save publishes it; a manager keeps the
last two of five checkpoints, and a model restored from it continues exactly; with
independent sharding groups, in both formats, each group's files are in the step's
directory and restore from it."""
import pytest

from xla_fsdp import launch
from xla_fsdp.checkpoint import CheckpointManager

from ...support.checks import nonempty
from ...support.manager_workloads import async_and_manager

WORLD = 2


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("manager"))
    return launch(async_and_manager, (WORLD, directory), num_devices=WORLD), directory


def test_an_asynchronous_save_holds_the_state_of_its_call(launched):
    out, directory = launched
    for rank in nonempty(range(WORLD), "ranks"):
        got = out[rank]
        assert got["pending_type"]
        assert got["first_published_by_second"]  # one save in flight: the next waits
        assert got["dcp_dir"].endswith("async_dcp")
        assert got["sharded_extra"] == {"step": 2} and got["sharded_state"]
        assert got["dcp_extra"] == {"step": 3} and got["dcp_state"]


def test_a_manager_keeps_the_last_two_and_resumes_exactly(launched):
    out, _ = launched
    for rank in nonempty(range(WORLD), "ranks"):
        got = out[rank]
        assert got["kept"] == ["latest", "step000008", "step000010"]
        assert got["latest"] == 10
        assert got["restored_extra"] == {"step": 10} and got["restored_state"]
        assert got["resumed_losses_equal"]
        assert got["step8_extra"] == {"step": 8}
        # torch_xla's preemption sync point is a TPU runtime's; here, SIGTERM alone
        assert "preemption sync point is a TPU's; this is CPU" in got["sync_point"]


@pytest.mark.parametrize("format, files", [
    ("dcp", ["COMPLETE", "dcp_group-000", "dcp_group-001"]),
    ("sharded", ["COMPLETE", "checkpoint_group-000_rank-00000000-of-00000001.pth",
                 "checkpoint_group-001_rank-00000000-of-00000001.pth"]),
])
def test_independent_sharding_groups_save_into_the_step_and_restore(launched, format, files):
    out, _ = launched
    for rank in nonempty(range(WORLD), "ranks"):
        got = out[rank]
        assert got[f"groups_{format}_kept"] == ["latest", "step000002", "step000003"]
        assert got[f"groups_{format}_step3"] == files
        assert got[f"groups_{format}_restored"] == {"step": 3}
        assert got[f"groups_{format}_state"]


@pytest.mark.parametrize("case, restored, steps", [
    ("fresh", None, "[1, 2, 3]"), ("fresh_later", None, "[3]"),
    ("rolled_back", {"run": 1, "step": 2}, "[3]"),
    ("rolled_back_later", {"run": 1, "step": 1}, "[2, 3]"),
])
def test_a_save_beside_another_runs_checkpoints_is_refused(launched, case, restored, steps):
    """[Note: one run per directory]: refused on every rank, nothing on disk changed."""
    out, _ = launched
    for rank in nonempty(range(WORLD), "ranks"):
        got = out[rank]
        assert got.get(f"{case}_restored") == restored
        assert f"holds complete checkpoints at steps {steps} outside this run's history" \
            in got[case]
        assert ("it started without restore()" if restored is None
                else f"it continued from step {restored['step']}") in got[case]
        assert got["unchanged"]


def test_a_manager_does_not_save_its_own_step_again_and_restores_a_given_step(launched):
    out, _ = launched
    for rank in nonempty(range(WORLD), "ranks"):
        got = out[rank]
        assert "the ranks see different complete checkpoints after 5 s (by rank: [[1, 2, " \
            "3], [1, 2]])" in got["lagging_restored"], got["lagging_restored"]
        assert got["missing_ok"] == (None, None)
        assert got["latest_restored"] == {"run": 1, "step": 3}
        # its own step, or one before the step it restored: nothing written
        assert got["own_step_again"] is False and got["older_step"] is False
        assert got["own_unchanged"]
        assert "step000007 is not a complete checkpoint on every rank; complete steps " \
               "here: [1, 2, 3]" in got["missing_step"]
        assert got["continued"] is True
        # rolled back by the manager that wrote the later steps: they are abandoned too
        assert got["rolled_back_in_process"] == ({"run": 1, "step": 2}, True)
        assert "holds complete checkpoints at steps [3, 4] outside this run's history (it " \
               "continued from step 2)" in got["after_rollback"], got["after_rollback"]



def test_a_process_that_only_traces_writes_and_removes_nothing(tmp_path, monkeypatch):
    """``xla_fsdp.aot`` plans a script whose directory holds a real run's checkpoints."""
    from xla_fsdp._xla import trace_only
    step = tmp_path / "step000002"
    step.mkdir()
    (step / "COMPLETE").write_text("2\n")
    (step / "checkpoint_rank-00000000-of-00000001.pth").write_text("the real run's")
    monkeypatch.setattr(trace_only, "_ACTIVE", True)
    manager = CheckpointManager(str(tmp_path), every=2, on_preemption=False)
    assert manager.latest() is None
    assert manager.save(2, model=None) is False and manager.save(4, model=None) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000002"]
    assert (step / "checkpoint_rank-00000000-of-00000001.pth").read_text() == "the real run's"


@pytest.mark.parametrize("kwargs, message", [
    ({"every": 0}, "every must be a positive integer"),
    ({"keep_last": 0}, "keep_last must be a positive integer"),
    ({"format": "zip"}, "format must be one of"),
])
def test_bad_settings_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckpointManager(str(tmp_path), **kwargs)


def test_a_save_never_waited_on_is_reported_at_exit(tmp_path):
    """See [Note: a save never waited on]: not published, and said so on every rank; a
    manager's ``with`` block publishes its save at the end."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = ("import sys\nfrom xla_fsdp import launch\n"
              "from tests.support.manager_workloads import unwaited_async_save\n"
              "if __name__ == '__main__':\n"
              "    launch(unwaited_async_save, (sys.argv[1],), num_devices=2)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("the asynchronous save of save_sharded "
                             f"{tmp_path / 'net'} was never published") == WORLD, done.stderr
    assert "Call wait() on the PendingSave" in done.stderr
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["managed"]
    assert CheckpointManager(str(tmp_path / "managed"), on_preemption=False).latest() == 3
