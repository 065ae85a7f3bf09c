"""Every layout round-trips through DCP, and through ``save_consolidated`` /
``load_consolidated``, exactly: saved at N = 4 one way, loaded at N = 2 another
way (flattened, dim-0, scanned and per-layer units, tied parameters in a module group, frozen
parameters, a parameter of no elements, a 0-d one under NAdam (trained on after the load),
bf16 compute, hybrid and independent sharding groups), the model equals the one
saved and a second save holds the same values, optimizer state included. Bad checkpoints are
refused, naming what is wrong, and change nothing; a hostile ``.metadata`` runs nothing
(workloads in ``support/dcp_workloads.py``).
"""
import os

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from xla_fsdp import launch

from ...support.checkpoint_workloads import assert_same_tree
from ...support.checks import nonempty
from ...support.dcp_workloads import CONFIGS, LOAD_WORLD, SAVE_WORLD, load_all, save_all

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trips(tmp_path_factory):
    first, second = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("second")
    saved = launch(save_all, (str(first),), num_devices=SAVE_WORLD)
    loaded = launch(load_all, (str(first), str(second)), num_devices=LOAD_WORLD)
    return {"first": first, "second": second, "saved": saved, "loaded": loaded}


def _torch_save(directory, tmp_path, name):
    out = str(tmp_path / f"{name}.pt")
    dcp_to_torch_save(str(directory), out)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_is_exact(trips, name, tmp_path):
    saved = trips["saved"][0][name]  # with independent groups, group 0's model and files
    for rank, result in nonempty(trips["loaded"].items(), "ranks loaded"):
        assert_same_tree(result[name], saved, f"rank {rank} {name}")
    suffix = "_group-000" if name == "groups_to_nested" else ""
    first = _torch_save(os.path.join(trips["first"], name + suffix), tmp_path, "first")
    second = _torch_save(os.path.join(trips["second"], name), tmp_path, "second")
    assert_same_tree(second, first, name)
    assert first["extra"] == {"config": name}
    assert first["optimizer"]["state"], "no optimizer state was saved"
    # through save_consolidated / load_consolidated instead: the same model and optimizer
    through = _torch_save(os.path.join(trips["second"], name + "_consolidated"), tmp_path,
                          "consolidated")
    assert_same_tree(through, first, f"{name} through a consolidated checkpoint")


def test_independent_groups_consolidate_a_file_each(trips):
    files = sorted(os.listdir(str(trips["first"]) + "_consolidated"))
    assert "groups_to_nested_group-000.pth" in files or \
        "groups_to_nested_group-000.safetensors" in files, files
    assert not [f for f in files if f.startswith("groups_to_nested.")], files


def test_groups_save_a_directory_each(trips):
    assert sorted(os.listdir(trips["first"])) == sorted(
        [n for n in CONFIGS if n != "groups_to_nested"]
        + ["groups_to_nested_group-000", "groups_to_nested_group-001"])


def test_bad_checkpoints_are_refused_and_change_nothing(trips):
    out = trips["loaded"][0]["refusals"]
    for label, message in out.items():
        print(f"{label}: {message}")
    assert "no such directory" in out["no_directory"]
    assert "has no .metadata" in out["no_metadata"]
    assert "truncated" in out["truncated"] and ".distcp" in out["truncated"]
    assert "data file missing" in out["missing_file"] and ".distcp" in out["missing_file"]
    assert "another optimizer class" in out["other_class"] and "momentum" in out["other_class"]
    assert "missing ['added.bias', 'added.weight'], unexpected []" in out["missing_keys"]
    assert "parameter 'head.weight' has shape [5, 32] in the checkpoint and [7, 32]" \
        in out["shape"]
    for label in ("hostile_metadata", "hostile_consolidated"):
        assert "damaged_hostile/.metadata: refuses to load io.open" in out[label], out[label]
    assert "param group 0 holds" in out["group_layout"], out["group_layout"]
    assert "saved in param groups of other settings (['lr', 'weight_decay'])" in \
        out["group_layout"], out["group_layout"]
    assert out["empty_group"]["lr"] == 0.25 and "betas" in out["empty_group"], out["empty_group"]
    assert out["hooked_group"] == (0.5, 1e-3), out["hooked_group"]
    for label in ("full_state_dict", "save_dcp", "save_consolidated"):
        message = out[f"extra_state_{label}"]
        assert message.startswith(f"{label}: "), message
        assert "['b1.up'] keep extra state (get_extra_state) that is not a tensor" in message, \
            message
    assert "missing ['b1.up._extra_state'], unexpected []" in out["extra_state_load_dcp"], \
        out["extra_state_load_dcp"]
    assert out["extra_state_per_rank"] == 7
    assert out["code_ran"] is False
    assert out["unchanged"] == [True, True]


def test_tensor_extra_state_goes_through_every_checkpoint(trips, tmp_path):
    """A module's extra state that is a tensor (TransformerEngine's FP8 metadata) saved at
    N=4, the first rank's unlike the others', and loaded at N=2 into another wrapping, from
    every format; a module's extra state that is an object, from a state dict's file (see
    [Note: modules' extra state])."""
    from xla_fsdp.checkpoint.consolidate.cli import main as consolidate
    first_rank = [i * 3 for i in range(7)]
    for rank, result in nonempty(trips["loaded"].items(), "ranks"):
        got = result["extra_state"]
        for label in ("dcp", "pt", "safetensors", "per_rank"):
            assert got[label] == first_rank, (rank, label, got[label])
        assert got["object"] == 9, (rank, got["object"])
        assert got["full_keys"] == ["b1.up._extra_state"], got["full_keys"]
        assert got["full_state_dict"] == [i * 3 for i in range(4 + rank)], (rank, got)
        assert "missing ['b1.up._extra_state'], unexpected []" in got["strict"], got["strict"]
        assert got["non_strict"] == (["b1.up._extra_state"], 4 + rank), got["non_strict"]
        assert "this rank refuses its extra state" in got["refused"], got["refused"]
        assert got["refused_unchanged"] == (2, True), (rank, got["refused_unchanged"])
        assert got["own_file"] == 2 and got["safetensors_extra"] == {"step": 3}, got
        assert got["shared_keys"] == ["alias._extra_state", "b1.up._extra_state"], got
    # the per-rank files consolidated offline carry the first rank's too
    out = str(tmp_path / "out.pth")
    assert consolidate(["--ckpt_prefix", str(trips["first"]) + "_extra_state/ck",
                        "--save_path", out]) == 0
    assert torch.load(out)["model"]["b1.up._extra_state"].tolist() == first_rank


def test_per_rank_files_with_extra_state_are_not_consolidated(trips, tmp_path, capsys):
    """The per-rank files keep a module's extra state (above), here a dict; a consolidation
    of them refuses, naming the module, rather than drop it."""
    from xla_fsdp.checkpoint.consolidate.cli import main as consolidate
    out = str(tmp_path / "out.pth")
    assert consolidate(["--ckpt_prefix", str(trips["second"] / "damaged_extra"),
                        "--save_path", out]) == 2
    assert "['b1.up'] keep extra state (get_extra_state) that is not a tensor" in \
        capsys.readouterr().err
    assert not os.path.exists(out)


@pytest.fixture(scope="module")
def failing_loads(tmp_path_factory):
    from ...support.checkpoint_workloads import commit_fails_on_one_rank
    tmp_path = tmp_path_factory.mktemp("failing_loads")
    return tmp_path, launch(commit_fails_on_one_rank, (2, str(tmp_path)), num_devices=2)


def test_per_rank_files_of_two_runs_are_not_loaded_together(failing_loads):
    _, out = failing_loads
    for rank in (0, 1):
        assert "come from different saves" in out[rank]["mixed"], out[rank]["mixed"]
        assert out[rank]["mixed_unchanged"], rank
        assert out[rank]["mixed_kept_by"] == [], out[rank]["mixed_kept_by"]  # refused reading
        bare = out[rank]["bare_state_dicts"]
        assert bare.startswith("CheckpointError: ") and "bare_rank-00000000-of-00000002.pth is " \
            "not a per-rank FSDP checkpoint: it holds a wrapped model's shards" in bare, bare


def test_per_rank_files_load_into_param_groups_split_otherwise(failing_loads):
    _, out = failing_loads
    for rank in (0, 1):
        lrs, with_state, saved_with_state, saved_lr = out[rank]["regrouped"]
        assert lrs == [saved_lr, saved_lr] and with_state == saved_with_state > 1, \
            out[rank]["regrouped"]


def test_an_extra_one_rank_cannot_pickle_fails_every_ranks_save(failing_loads):
    """The per-rank saves keep each rank's extra: every rank raises, none waits for the
    others. A consolidated save keeps the first rank's, so the last rank's is never read."""
    _, out = failing_loads
    for kind in ("dcp", "sharded"):
        for rank in (0, 1):
            assert out[rank][f"{kind}_unpicklable"] != "no error", (kind, rank)
    assert "the save's extra" in out[1]["dcp_unpicklable"], out[1]["dcp_unpicklable"]
    assert out[0]["consolidated_unpicklable"] == out[1]["consolidated_unpicklable"] == \
        "no error"


def test_a_commit_that_fails_on_one_rank_changes_nothing_anywhere(failing_loads):
    tmp_path, out = failing_loads
    for kind, where in (("dcp", "dcp"), ("sharded", "ck_rank-00000001-of-00000002.pth"),
                        ("consolidated", "full.pth")):
        failed = f"CheckpointError: {tmp_path / where}: ValueError: refused by this rank's "
        assert out[1][kind].startswith(failed), out[1][kind]
        assert out[0][kind].startswith("CheckpointError: rank 1 failed, so this rank stopped "
                                       "too: " + failed), out[0][kind]
        assert out[0][f"{kind}_unchanged"] and out[1][f"{kind}_unchanged"], kind
        assert out[0][f"{kind}_kept_by"] == out[1][f"{kind}_kept_by"] == [], kind
