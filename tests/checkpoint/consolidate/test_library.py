"""consolidate.library: torch_xla's consolidation functions on our reader, without XLA.

Waiting for a set still being written (missing ranks, a half-written file, a file left
from an earlier save), optimizer state from torch_xla-recipe files, and in-memory state
dicts consolidated exactly like files."""
import threading
import time

import pytest
import torch

from xla_fsdp.checkpoint.consolidate.library import (consolidate_checkpoint_files,
                                                     consolidate_state_dicts)
from xla_fsdp.checkpoint.per_rank import shard_set
from xla_fsdp.checkpoint.per_rank.shard_set import IncompleteCheckpoint
from xla_fsdp.checkpoint.files import CheckpointError

from ...support.synthetic_checkpoints import SHAPES, full_model, write_set
from ...support.checks import every, nonempty


def _later(seconds, fn, *args, **kwargs):
    thread = threading.Thread(target=lambda: (time.sleep(seconds), fn(*args, **kwargs)))
    thread.start()
    return thread


def test_waits_for_ranks_still_writing(tmp_path):
    prefix = str(tmp_path / "ckpt")
    write_set(prefix, 4, ranks=[0], recipe=True)
    writer = _later(1.0, write_set, prefix, 4, ranks=[1, 2, 3], recipe=True)
    start = time.monotonic()
    state, path = consolidate_checkpoint_files(prefix, "_rank-*-of-*.pth", save_model=False)
    writer.join()
    assert time.monotonic() - start >= 1.0 and path is None
    full = full_model()
    assert every(torch.equal(state[n], full[n]) for n in SHAPES)


def test_timeout_names_the_missing_ranks_and_a_long_wait_is_said(tmp_path, monkeypatch):
    # offline, a missing file never comes: the wait (600 s by default) is said early on
    monkeypatch.setattr(shard_set, "_SAY_WAITING_AFTER", 0.2)
    prefix = str(tmp_path / "ckpt")
    write_set(prefix, 4, ranks=[0, 2], recipe=True)
    with pytest.raises(IncompleteCheckpoint, match=r"waited 0.5 s.*ranks \[1, 3\] are missing"), \
            pytest.warns(UserWarning, match=r"still waiting, up to 0.5 s in all, .*ranks "
                                            r"\[1, 3\] are missing"):
        consolidate_checkpoint_files(prefix, "_rank-*-of-*.pth", save_model=False,
                                     wait_seconds=0.5)


def test_half_written_file_is_waited_for(tmp_path):
    prefix = str(tmp_path / "ckpt")
    paths = write_set(prefix, 2, recipe=True)
    whole = open(paths[1], "rb").read()
    with open(paths[1], "wb") as f:
        f.write(whole[:len(whole) // 2])
    restorer = _later(0.5, lambda: open(paths[1], "wb").write(whole))
    state, _ = consolidate_checkpoint_files(prefix, "_rank-*-of-*.pth", save_model=False)
    restorer.join()
    assert torch.equal(state["lin.bias"], full_model()["lin.bias"])


def test_file_from_an_earlier_save_is_waited_for(tmp_path):
    prefix = str(tmp_path / "ckpt")
    write_set(prefix, 2, recipe=True, update_count=3, full=full_model(1))  # last epoch
    write_set(prefix, 2, recipe=True, update_count=6, ranks=[0])           # this save, rank 0
    _later(0.5, write_set, prefix, 2, recipe=True, update_count=6, ranks=[1])
    state, _ = consolidate_checkpoint_files(prefix, "_rank-*-of-*.pth", save_model=False)
    assert torch.equal(state["lin.weight"], full_model()["lin.weight"])
    write_set(prefix, 2, recipe=True, update_count=9, ranks=[1])
    with pytest.raises(IncompleteCheckpoint, match="different saves"):
        consolidate_checkpoint_files(prefix, "_rank-*-of-*.pth", save_model=False,
                                     wait_seconds=0.3)


def test_no_files_fails_at_once(tmp_path):
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="no files match"):
        consolidate_checkpoint_files(str(tmp_path / "none"), save_model=False)
    assert time.monotonic() - start < 5


def test_recipe_optimizer_is_consolidated_and_output_is_not_an_input(tmp_path):
    prefix = str(tmp_path / "ckpt")
    write_set(prefix, 3, recipe=True)
    for _ in range(2):  # the default '*.pth' matches the output: the second run must skip it
        state, path = consolidate_checkpoint_files(prefix)
    assert path == prefix + "_consolidated.pth"
    saved = torch.load(path, weights_only=True)
    full = full_model()
    assert saved["optimizer_param_names"] == list(SHAPES)
    for i, name in enumerate(nonempty(SHAPES, "parameters")):
        assert torch.equal(saved["model"][name], full[name])
        assert torch.equal(saved["optimizer"]["state"][i]["momentum_buffer"], full[name] * 0.5)
    optimizer = torch.optim.SGD([torch.nn.Parameter(full[n].clone()) for n in SHAPES], lr=0.1,
                                momentum=0.9)
    optimizer.load_state_dict(saved["optimizer"])


def test_recipe_optimizer_with_unknown_mapping_is_left_out(tmp_path):
    prefix = str(tmp_path / "ckpt")
    write_set(prefix, 2, recipe=True, param_groups=[[0], [1]])  # e.g. decay / no decay
    _, path = consolidate_checkpoint_files(prefix, "_rank-*-of-*.pth")
    saved = torch.load(path, weights_only=True)
    assert "optimizer" not in saved and set(saved["model"]) == set(SHAPES)


def test_state_dicts_consolidate_like_files(tmp_path):
    prefix = str(tmp_path / "ckpt")
    paths = write_set(prefix, 4, recipe=True)
    trees = [torch.load(p, weights_only=True) for p in paths]
    from_memory = consolidate_state_dicts([t["model"] for t in trees], trees[0]["shard_metadata"])
    from_files, _ = consolidate_checkpoint_files(prefix, "_rank-*-of-*.pth", save_model=False)
    assert list(from_memory) == list(from_files) == list(SHAPES)
    assert every(torch.equal(from_memory[k], from_files[k]) for k in SHAPES)
    with pytest.raises(CheckpointError, match="3 state dicts for a world of 4"):
        consolidate_state_dicts([t["model"] for t in trees[:3]], trees[0]["shard_metadata"])

