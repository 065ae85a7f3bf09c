"""The directory of step checkpoints: complete means marked, retention and leftovers."""
import os

import pytest

from xla_fsdp.checkpoint.manager.directory import CheckpointDirectory, step_name


def _save(d, step):
    path = d.prepare(step)
    with open(os.path.join(path, "checkpoint_rank-0.pth"), "w") as f:
        f.write("x")
    d.mark_complete(step)


def test_latest_is_the_newest_marked_step(tmp_path):
    d = CheckpointDirectory(str(tmp_path))
    assert d.latest() is None
    for step in (100, 200):
        _save(d, step)
    d.prepare(300)  # a save killed midway: files, no marker
    open(os.path.join(d.path(300), "checkpoint_rank-0.pth"), "w").close()
    assert d.latest() == 200
    assert open(tmp_path / "latest").read() == "step000200\n"
    assert sorted(os.listdir(tmp_path)) == ["latest", "step000100", "step000200", "step000300"]


def test_keep_last_removes_only_older_complete_checkpoints(tmp_path):
    d = CheckpointDirectory(str(tmp_path))
    for step in range(1, 6):
        _save(d, step)
        d.keep_last(2)
    d.prepare(6)  # in flight: neither counted nor removed by retention
    assert d.complete_steps() == [4, 5]
    assert d.keep_last(2) == []
    assert os.path.isdir(d.path(6))
    with pytest.raises(ValueError):
        step_name(-1)
    assert step_name(1234567) == "step1234567"


def test_leftovers_are_unmarked_directories_and_temporary_files(tmp_path):
    d = CheckpointDirectory(str(tmp_path))
    _save(d, 4)
    d.prepare(8)
    open(os.path.join(d.path(8), ".checkpoint_rank-0.pth.tmp-1-ab"), "w").close()
    open(tmp_path / ".latest.tmp-1-cd", "w").close()
    assert sorted(d.remove_leftovers()) == [".latest.tmp-1-cd", "step000008"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step000004"]
    assert d.latest() == 4
