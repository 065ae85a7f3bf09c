"""Scanned layers' stacked shards: consolidation to per-layer names, resharding, optimizer
state, and refusal of stacked metadata this version cannot read. No XLA."""
import re

import pytest
import torch

from xla_fsdp.checkpoint.consolidate import main
from xla_fsdp.checkpoint.consolidate.library import consolidate_state_dicts

from ...support.synthetic_checkpoints import (LAYERS, STACK_PATH, stacked_full_model, stacked_names,
                        write_stacked)
from ...support.checks import every, nonempty

KINDS = ["flat", "interleaved", "dim0", "flat_multi"]


def _consolidate(capsys, prefix, out, *extra):
    code = main(["--ckpt_prefix", prefix, "--save_path", out, *extra])
    assert code == 0, capsys.readouterr().err
    return torch.load(out, weights_only=True)


def _check_consolidated(result, full):
    names = stacked_names()
    assert list(result["model"]) == names
    for name in nonempty(names, "parameter names"):
        assert torch.equal(result["model"][name], full[name]), name
    assert result["optimizer_param_names"] == names
    state = result["optimizer"]["state"]
    for i, name in enumerate(nonempty(names, "parameter names")):
        assert torch.equal(state[i]["exp_avg"], full[name] * 0.5), name
        assert torch.equal(state[i]["exp_avg_sq"], full[name] * full[name]), name
        assert state[i]["step"] == 3.0


@pytest.mark.parametrize("world, multiple", [(1, 1), (3, 2), (4, 1)])
@pytest.mark.parametrize("kind", KINDS)
def test_merge_gives_per_layer_names_and_values(tmp_path, capsys, kind, world, multiple):
    prefix = str(tmp_path / "ck")
    write_stacked(prefix, world, kind, multiple)
    result = _consolidate(capsys, prefix, str(tmp_path / "out.pth"))
    _check_consolidated(result, stacked_full_model())
    # the optimizer loads into one over the unwrapped model's parameters
    params = [torch.nn.Parameter(result["model"][n].clone()) for n in stacked_names()]
    optimizer = torch.optim.Adam(params, lr=0.1)
    optimizer.load_state_dict(result["optimizer"])
    assert torch.equal(optimizer.state[params[-1]]["exp_avg"],
                       result["model"][stacked_names()[-1]] * 0.5)


@pytest.mark.parametrize("kind", KINDS)
def test_reshard_equals_a_save_at_the_new_world_size(tmp_path, capsys, kind):
    prefix, direct = str(tmp_path / "ck"), str(tmp_path / "direct")
    write_stacked(prefix, 3, kind, multiple=2)
    write_stacked(direct, 5, kind, multiple=2)
    assert main(["--ckpt_prefix", prefix, "--reshard", "5",
                 "--save_path", str(tmp_path / "r")]) == 0, capsys.readouterr().err
    for rank in range(5):
        name = f"_rank-{rank:08d}-of-00000005.pth"
        got = torch.load(str(tmp_path / "r") + name, weights_only=True)
        want = torch.load(direct + name, weights_only=True)
        assert got["shard_metadata"] == want["shard_metadata"]
        assert got["model"].keys() == want["model"].keys()
        for key, tensor in nonempty(want["model"].items(), f"rank {rank}'s shards"):
            assert torch.equal(got["model"][key], tensor), (rank, key)
        for index, state in nonempty(want["optimizer"]["state"].items(),
                                     f"rank {rank}'s optimizer states"):
            for name_, value in nonempty(state.items(), f"rank {rank}'s state {index}"):
                assert torch.equal(got["optimizer"]["state"][index][name_], value)


@pytest.mark.parametrize("kind", KINDS)
def test_reshard_round_trip(tmp_path, capsys, kind):
    prefix = str(tmp_path / "ck")
    write_stacked(prefix, 3, kind, multiple=2)
    at = prefix
    for world in (2, 1, 4):
        nxt = str(tmp_path / f"r{world}")
        assert main(["--ckpt_prefix", at, "--reshard", str(world),
                     "--save_path", nxt]) == 0, capsys.readouterr().err
        at = nxt
    result = _consolidate(capsys, at, str(tmp_path / "out.pth"))
    _check_consolidated(result, stacked_full_model())


def test_safetensors_output(tmp_path, capsys):
    from safetensors.torch import load_file
    prefix = str(tmp_path / "ck")
    write_stacked(prefix, 3, "interleaved")
    assert main(["--ckpt_prefix", prefix, "--format", "safetensors",
                 "--save_path", str(tmp_path / "out.safetensors")]) == 0
    model = load_file(str(tmp_path / "out.safetensors"))
    full = stacked_full_model()
    assert set(model) == set(full) and every(torch.equal(model[n], full[n]) for n in full)


def test_state_dicts_in_memory(tmp_path):
    paths = write_stacked(str(tmp_path / "ck"), 3, "dim0")
    trees = [torch.load(p, weights_only=True) for p in paths]
    out = consolidate_state_dicts([t["model"] for t in trees], trees[0]["shard_metadata"])
    full = stacked_full_model()
    assert list(out) == stacked_names() and every(torch.equal(out[n], full[n]) for n in full)


def _edit_metadata(paths, edit):
    """Rewrites every rank file with ``edit`` applied to its shard metadata."""
    for path in paths:
        tree = torch.load(path, weights_only=True)
        edit(tree["shard_metadata"])
        tree.pop("xla_fsdp")  # its fingerprint would no longer match; read as a recipe file
        torch.save(tree, path)


def _stacked_entry(md):
    return next(iter(md["layout_info"][STACK_PATH].values()))


@pytest.mark.parametrize("edit, message", [
    (lambda md: _stacked_entry(md).update(kind="ring"), "layout kind 'ring'"),
    (lambda md: _stacked_entry(md).update(layer_kind="ring"), "layer kind 'ring'"),
    (lambda md: md["stack_info"].clear(), "no stack_info entry"),
    (lambda md: _stacked_entry(md).update(layers=LAYERS + 1), "does not fit"),
    (lambda md: _stacked_entry(md).update(multiple=4), "metadata .* says"),
    (lambda md: _stacked_entry(md).update(kind="flat"), "stack_info entry but layout kind"),
])
def test_unreadable_stacked_metadata_is_refused(tmp_path, capsys, edit, message):
    prefix = str(tmp_path / "ck")
    _edit_metadata(write_stacked(prefix, 3, "flat", multiple=2), edit)
    assert main(["--ckpt_prefix", prefix, "--save_path", str(tmp_path / "out.pth")]) == 2
    err = capsys.readouterr().err
    assert "nothing was written" in err
    assert re.search(message, err), err
    assert not (tmp_path / "out.pth").exists()

