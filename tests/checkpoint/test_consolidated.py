"""``save_consolidated``: one rank writes the consolidated checkpoint while the shards come to it
over the collectives, and the result equals what ``consolidate_sharded_ckpts`` makes of the
per-rank files, in every format; the other ranks write nothing. The HF directory is what
``save_pretrained`` writes and ``from_pretrained`` loads with nothing missing."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import LlamaConfig, LlamaForCausalLM

from xla_fsdp import launch
from xla_fsdp.checkpoint.consolidate.cli import main as consolidate

from ..support.checkpoint_workloads import assert_same_tree
from ..support.consolidated_workloads import CONFIG, FORMATS, WORLD, llama, save_everything
from ..support.checks import every, nonempty


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("consolidated")
    LlamaConfig(**dict(CONFIG, hidden_size=48), architectures=["LlamaForCausalLM"]).save_pretrained(
        str(root / "wrong_config"))
    results = launch(save_everything, (str(root),), num_devices=WORLD)
    return root, results


def _offline(root, fmt, tmp_path):
    out = str(tmp_path / f"offline_{fmt}")
    args = ["--ckpt_prefix", str(root / "shared" / "ck"), "--format", fmt, "--save_path", out]
    assert consolidate(args) == 0
    return out


def test_only_the_first_rank_writes(saved):
    root, results = saved
    for rank in nonempty(range(1, WORLD), "ranks but the first"):
        assert every(results[rank][f] is None for f in FORMATS), results[rank]
        assert results[rank]["files"] == [], results[rank]["files"]
    assert results[0]["files"] == sorted(
        ["online_pt", "online_safetensors", "online_safetensors.optimizer.pth", "online_hf",
         "online_dcp", "online_one_sync"])


def test_pt_and_safetensors_equal_the_offline_consolidation(saved, tmp_path):
    root, results = saved
    offline = torch.load(_offline(root, "pt", tmp_path), weights_only=True)
    online = torch.load(results[0]["pt"][0], weights_only=True)
    assert_same_tree(online, offline)
    assert offline["optimizer"]["state"], "no optimizer state"
    assert_same_tree(load_file(results[0]["safetensors"][0]),
           load_file(_offline(root, "safetensors", tmp_path)))


def test_dcp_equals_the_offline_consolidation(saved, tmp_path):
    root, results = saved
    got = {}
    for name, directory in (("online", results[0]["dcp"][0]),
                            ("offline", _offline(root, "dcp", tmp_path))):
        dcp_to_torch_save(directory, str(tmp_path / f"{name}.pt"))
        got[name] = torch.load(str(tmp_path / f"{name}.pt"), weights_only=False)
    assert_same_tree(got["online"], got["offline"])
    extra = got["online"]["extra"]
    assert extra["step"] == 1 and torch.equal(extra["seen"], torch.arange(3.0)), extra


def test_hf_directory_loads_with_from_pretrained(saved, tmp_path):
    root, results = saved
    full = results[0]["full"]
    directory = results[0]["hf"][0]
    model, info = LlamaForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [],
                    "error_msgs": []}
    assert_same_tree(model.state_dict(), full)
    assert json.load(open(os.path.join(directory, "config.json")))["hidden_size"] == 32
    # what save_pretrained writes for the same weights, split alike
    reference = llama()
    reference.load_state_dict(full)
    reference.save_pretrained(str(tmp_path / "reference"), max_shard_size="40KB")
    config_dir = str(tmp_path / "reference")
    out = str(tmp_path / "ours")
    assert consolidate(["--ckpt_prefix", str(root / "shared" / "ck"), "--format", "hf",
                        "--hf_config", config_dir, "--max_shard_size", "40KB",
                        "--save_path", out]) == 0
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    want = json.load(open(os.path.join(config_dir, "model.safetensors.index.json")))
    assert index["weight_map"] == want["weight_map"]
    assert index["metadata"] == want["metadata"]
    assert sorted(os.listdir(out)) == sorted(os.listdir(config_dir))
    for f in nonempty(set(index["weight_map"].values()), "weight files"):
        assert_same_tree(load_file(os.path.join(out, f)), load_file(os.path.join(config_dir, f)), f)


def test_a_config_that_does_not_fit_the_weights_is_refused(saved, tmp_path, capsys):
    root, results = saved
    for rank in nonempty(range(WORLD), "ranks"):
        assert "does not describe these weights" in results[rank]["refused"]
        assert "model.embed_tokens.weight: weights [100, 32], config [100, 48]" in \
            results[rank]["refused"]
    out = str(tmp_path / "refused")
    assert consolidate(["--ckpt_prefix", str(root / "shared" / "ck"), "--format", "hf",
                        "--hf_config", str(root / "wrong_config"), "--save_path", out]) == 2
    assert "does not describe these weights" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_a_failed_save_keeps_nothing_alive(saved):
    """The refused save's exception, raised on every rank, is named by none of the frames it
    passed through: such a frame keeps its model and optimizer alive in a reference cycle
    until the garbage collector runs, on the failing rank alone."""
    _, results = saved
    assert [results[rank]["kept_by"] for rank in range(WORLD)] == [[]] * WORLD


def test_each_optimizer_state_is_gathered_once_per_run_of_its_shard(saved):
    """At one tensor per sync, the writer gathers a shard's optimizer state as often as the
    shard itself: once for each run of its parameters in the model's order (the root's
    embedding, then its final norm and head), not once per parameter (a decoder layer's
    flat shard holds nine). The outputs, read in that order, are the offline ones (above)."""
    root, results = saved
    for fmt in ("pt", "dcp"):
        runs = results[0]["gathered"][fmt]
        assert every(len(run) == 1 for run in runs), (fmt, runs)
        tids = [tid for run in runs for tid in run]
        shards = {t for t in tids if "#" in t}
        assert shards, f"{fmt}: no optimizer state was gathered"
        for state in nonempty(shards, "gathered optimizer states"):
            shard = state.split("#")[0]
            assert tids.count(state) == tids.count(shard) >= 1, (fmt, state, tids)


def test_a_small_model_is_gathered_in_one_sync_each_tensor_once(saved):
    """At the default run size every tensor the writer reads comes in one sync: the three
    shards (the root's and two decoder layers') and AdamW's two sharded states of each, each
    gathered once though the writer reads the root's shard twice."""
    root, results = saved
    runs = results[0]["gathered"]["one_sync"]
    assert len(runs) == 1, runs
    (run,) = runs
    shards = [t for t in run if "#" not in t]
    assert len(run) == len(set(run)) == 9 and len(shards) == 3, run
    assert sorted(t.split("#")[1] for t in run if "#" in t) == ["exp_avg"] * 3 + ["exp_avg_sq"] * 3
    assert_same_tree(torch.load(os.path.join(root, "rank-0", "online_one_sync"), weights_only=True),
                     torch.load(results[0]["pt"][0], weights_only=True))
