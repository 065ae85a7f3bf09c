"""``load_consolidated`` and ``load_full_optim_state_dict``: checkpoints of the unwrapped model
written by other tools (a sharded Hugging Face directory from ``save_pretrained``, a
safetensors file with our optimizer file beside it, a ``torch.save`` file) load into the
sharded model at N = 2 and 4 exactly, each rank reading about its share of the bytes; with
``first_rank_reads`` only rank 0's host has the checkpoint; training continued after each
way of loading (files, rank 0 only, a full state dict and a by-name optimizer state in
memory) matches training continued unsharded from the same state; bad input is refused
naming the file or key, on every rank, and changes nothing."""
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from xla_fsdp import launch

from ..support.load_workloads import (PARTIAL_DROPPED, STEPS, llama, load_everything,
                                     trained_state, write_corrupted)
from ..support.parity import paired
from ..support.checks import every, nonempty

pytestmark = pytest.mark.slow  # the module's launch loads every format at N = 2 and 4

LOSS_BOUND, ADAM_PARAM_BOUND = 1e-5, 1e-5


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("load_consolidated")
    state = trained_state()
    state["model"].save_pretrained(str(root / "hf"), max_shard_size="20KB")
    save_file(state["sd"], str(root / "ck.safetensors"))
    torch.save({"optimizer": state["osd"], "optimizer_param_names": state["names"]},
               str(root / "ck.optimizer.pth"))
    torch.save({"model": state["sd"], "optimizer": state["osd"],
                "optimizer_param_names": state["names"], "extra": {"step": 1}},
               str(root / "ck.pth"))
    torch.save(state["osd_by_name"], str(root / "osd_by_name.pt"))
    for rank in range(4):
        os.makedirs(root / f"host-{rank}")
    shutil.copy(root / "ck.pth", root / "host-0" / "ck.pth")
    shutil.copy(root / "ck.safetensors", root / "lone.safetensors")  # no optimizer file
    write_corrupted(str(root / "corrupted.safetensors"), state["sd"], "model.norm.weight")
    shutil.copytree(root / "hf", root / "hf_missing_shard")
    os.remove(root / "hf_missing_shard" / "model-00002-of-00006.safetensors")
    wide = llama()
    wide.config.intermediate_size = 96
    type(wide)(wide.config).save_pretrained(str(root / "hf_wide"))
    results = {4: launch(load_everything, (str(root), True), num_devices=4),
               2: launch(load_everything, (str(root), False), num_devices=2)}
    return root, state, results


def test_the_hf_directory_is_sharded(loaded):
    root, _, _ = loaded
    files = sorted(os.listdir(root / "hf"))
    assert files == ["config.json", "generation_config.json"] + [
        f"model-0000{i}-of-00006.safetensors" for i in range(1, 7)] + [
        "model.safetensors.index.json"], files


def test_every_format_loads_exactly_at_any_world_size(loaded):
    root, state, results = loaded
    for world, by_rank in nonempty(results.items(), "world sizes"):
        for rank, out in nonempty(by_rank.items(), "ranks"):
            for name, full in nonempty(out["full"].items(), "ways of loading"):
                assert set(full) == set(state["sd"]), (world, name)
                for key, value in nonempty(state["sd"].items(), "state entries"):
                    assert torch.equal(full[key], value), (world, rank, name, key)
            assert out["extra_pt"] == {"step": 1} and out["extra_hf"] is None


def test_the_optimizer_state_loads_exactly(loaded):
    """What was loaded, written back by save_consolidated, is the state that was saved."""
    root, state, results = loaded
    for world in nonempty(results, "world sizes"):
        back = torch.load(root / f"rank-0-of-{world}" / "back.pth", weights_only=True)
        assert back["optimizer_param_names"] == state["names"]
        assert back["optimizer"]["param_groups"] == state["osd"]["param_groups"]
        for index, values in nonempty(state["osd"]["state"].items(), "optimizer states"):
            for key, value in nonempty(values.items(), f"parameter {index}'s state"):
                assert torch.equal(back["optimizer"]["state"][index][key], value), (index, key)


def test_each_rank_reads_its_share(loaded):
    """Together the ranks read everything once; each about its share (the tied embedding
    once), plus the whole tensors every rank needs: a step count per parameter."""
    root, state, results = loaded
    model_bytes = sum(p.numel() * p.element_size() for p in state["model"].parameters())
    steps = 4 * len(state["names"])
    for world, by_rank in nonempty(results.items(), "world sizes"):
        for name in ("pt", "safetensors", "hf"):
            got = [by_rank[r]["bytes"][name] for r in range(world)]
            # with the optimizer: AdamW's two moments, sharded like the parameters
            tensors = model_bytes * (1 if name == "hf" else 3)
            assert sum(got) >= tensors, (world, name, got)
            assert max(got) <= tensors / world + 64 + (0 if name == "hf" else steps), \
                (world, name, got, tensors / world)


def test_only_the_first_rank_opens_the_file(loaded):
    root, _, results = loaded
    for world, by_rank in nonempty(results.items(), "world sizes"):
        assert by_rank[0]["host_files"] == ["ck.pth"]
        assert every(by_rank[r]["host_files"] == [] for r in range(1, world))


def test_training_continues_as_unsharded(loaded):
    root, _, results = loaded
    reference = results[2][0]["reference"]
    for rank, out in nonempty(results[4].items(), "ranks"):
        for way in ("losses_pt", "losses_first_rank", "losses_in_memory"):
            for step, (a, b) in paired(out[way], reference["losses"]):
                assert abs(a - b) <= LOSS_BOUND * abs(b), (rank, way, step, a, b)
            assert len(out[way]) == STEPS
    full = results[4][0]["trained_full"]
    for key, value in nonempty(reference["params"].items(), "parameters"):
        diff = (full[key] - value).abs()
        assert diff.max() <= ADAM_PARAM_BOUND, (key, diff.max())


def test_bad_input_is_refused_and_changes_nothing(loaded):
    root, _, results = loaded
    for world, by_rank in nonempty(results.items(), "world sizes"):
        for rank, out in nonempty(by_rank.items(), "ranks"):
            errors = out["errors"]
            assert "model-00002-of-00006.safetensors, which is missing" in \
                errors["missing_shard"], errors["missing_shard"]
            assert "hf_wide" in errors["wrong_config"] and "mlp" in errors["wrong_config"] \
                and "shape" in errors["wrong_config"], errors["wrong_config"]
            assert "ck.pth" in errors["other_optimizer"] and "another optimizer class" in \
                errors["other_optimizer"], errors["other_optimizer"]
            assert "lone.safetensors holds no optimizer state: the file that would hold " \
                "it, " in errors["no_companion"] and \
                "lone.optimizer.pth, is missing" in errors["no_companion"], errors["no_companion"]
            # [Note: checksums in a safetensors header]: one rank checks the tensor, every
            # rank is told
            assert "corrupted.safetensors: tensor 'model.norm.weight' fails its CRC-32 " \
                "check" in errors["corrupted"], errors["corrupted"]
            assert "numbers its parameters" in errors["unnamed_optimizer"], \
                errors["unnamed_optimizer"]
            assert errors["strict_partial"].startswith(
                "CheckpointError: the state dict does not hold this model") and \
                f"missing ['{PARTIAL_DROPPED}'], unexpected ['not_in_the_model']" in \
                errors["strict_partial"], errors["strict_partial"]
            assert out["unchanged_after_errors"], (world, rank)
            assert out["non_strict"] == ([PARTIAL_DROPPED], ["not_in_the_model"], True, True)
