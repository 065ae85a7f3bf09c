"""The consolidation CLI on small synthetic checkpoints: results, and every refusal (which
must name the file at fault and write nothing). No XLA."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from xla_fsdp.checkpoint.consolidate import main
from xla_fsdp.checkpoint.files import CheckpointFile

from ...support.synthetic_checkpoints import full_model, write_set
from ...support.checks import every


def _run(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr()


@pytest.mark.parametrize("flattened", [False, True])
@pytest.mark.parametrize("world", [1, 3, 8])
def test_consolidates_model_and_optimizer(tmp_path, capsys, world, flattened):
    prefix = str(tmp_path / "ck")
    write_set(prefix, world, flattened=flattened)
    code, out = _run(capsys, "--ckpt_prefix", prefix)
    assert code == 0, out.err
    assert "verified" in out.out
    result = torch.load(prefix + "_consolidated.pth", weights_only=True)
    full = full_model()
    lin = torch.nn.Linear(3, 5)
    lin.load_state_dict({k.split(".", 1)[1]: v for k, v in result["model"].items()})
    assert every(torch.equal(result["model"][k], v) for k, v in full.items())
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(result["optimizer"])
    assert torch.equal(opt.state[lin.weight]["momentum_buffer"], full["lin.weight"] * 0.5)
    assert torch.equal(opt.state[lin.bias]["momentum_buffer"], full["lin.bias"] * 0.5)
    assert opt.state[lin.bias]["step"] == 7.0
    assert result["optimizer_param_names"] == ["lin.weight", "lin.bias"]


@pytest.mark.parametrize("flattened", [False, True])
def test_reshard_round_trip(tmp_path, capsys, flattened):
    prefix = str(tmp_path / "ck")
    write_set(prefix, 4, flattened=flattened)
    assert _run(capsys, "--ckpt_prefix", prefix, "--reshard", "3",
                "--save_path", str(tmp_path / "r"))[0] == 0
    assert len(list(tmp_path.glob("r_rank-*-of-00000003.pth"))) == 3
    assert _run(capsys, "--ckpt_prefix", str(tmp_path / "r"),
                "--save_path", str(tmp_path / "out.pth"))[0] == 0
    result = torch.load(tmp_path / "out.pth", weights_only=True)
    assert every(torch.equal(result["model"][k], v) for k, v in full_model().items())


def test_python_dash_m_and_console_script(tmp_path):
    prefix = str(tmp_path / "ck")
    write_set(prefix, 2)
    for cmd in ([sys.executable, "-m", "xla_fsdp.checkpoint.consolidate"],
                [shutil.which("consolidate_sharded_ckpts")]):
        if os.path.exists(prefix + "_consolidated.pth"):
            os.remove(prefix + "_consolidated.pth")
        done = subprocess.run(cmd + ["--ckpt_prefix", prefix], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert os.path.exists(prefix + "_consolidated.pth")


@pytest.mark.parametrize("replica", [True, False])
def test_files_of_two_sharding_groups(tmp_path, capsys, replica):
    """torch_xla's recipe under sharding_groups of two: every rank writes its file, named by
    its global rank, and each group numbers its ranks 0 and 1 ([Note: files of several
    sharding groups]). Replicas' files are one checkpoint; independent groups' are refused."""
    prefix = str(tmp_path / "ck")
    for index in (0, 1):
        for rank, path in enumerate(write_set(str(tmp_path / f"g{index}"), 2, recipe=True,
                                              sharding_group=(index, replica))):
            os.rename(path, f"{prefix}_rank-{2 * index + rank:08d}-of-00000004.pth")
    if not replica:
        assert "files of sharding groups 0 and 1, each holding a different part" in \
            _refusal(tmp_path, capsys, "--ckpt_prefix", prefix)
        return
    code, out = _run(capsys, "--ckpt_prefix", prefix)
    assert code == 0, out.err
    result = torch.load(prefix + "_consolidated.pth", weights_only=True)
    assert every(torch.equal(result["model"][k], v) for k, v in full_model().items())


def _refusal(tmp_path, capsys, *args):
    before = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    code, out = _run(capsys, *args)
    after = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert code == 2
    assert after == before, "a refused run wrote or touched files"
    assert "nothing was written" in out.err
    return out.err


def test_refusals_name_the_fault(tmp_path, capsys):
    prefix = str(tmp_path / "ck")
    paths = write_set(prefix, 4)
    # no match
    assert "no files match" in _refusal(tmp_path, capsys, "--ckpt_prefix", prefix + "x")
    # output that matches the input glob (torch_xla's default suffix '*.pth' would do this)
    err = _refusal(tmp_path, capsys, "--ckpt_prefix", prefix, "--ckpt_suffix", "*.pth",
                   "--save_path", prefix + "_rank-9.pth")
    assert "matches the input pattern" in err
    err = _refusal(tmp_path, capsys, "--ckpt_prefix", prefix, "--save_path", paths[1])
    assert "overwrite an input" in err
    # an output path that is a directory: the filesystem's error, as the tool reports errors
    (tmp_path / "out_dir").mkdir()
    err = _refusal(tmp_path, capsys, "--ckpt_prefix", prefix, "--save_path",
                   str(tmp_path / "out_dir"))
    assert "IsADirectoryError" in err and "out_dir" in err, err
    # missing rank
    os.rename(paths[2], str(tmp_path / "aside"))
    err = _refusal(tmp_path, capsys, "--ckpt_prefix", prefix)
    assert "ranks [2] are missing" in err
    os.rename(str(tmp_path / "aside"), paths[2])
    # duplicate rank: a copy of rank 1 under another name
    shutil.copy(paths[1], prefix + "_rank-00000009-of-00000004.pth")
    err = _refusal(tmp_path, capsys, "--ckpt_prefix", prefix)
    assert "both hold rank 1" in err
    os.remove(prefix + "_rank-00000009-of-00000004.pth")
    # a consolidated checkpoint among the inputs
    torch.save({"model": {}}, prefix + "_rank-x-of-y.pth")
    err = _refusal(tmp_path, capsys, "--ckpt_prefix", prefix)
    assert "_rank-x-of-y.pth is not a per-rank FSDP checkpoint" in err and \
        "load it with load_consolidated, or narrow the pattern" in err, err
    # a wrapped model's state_dict() alone, its shards without the metadata
    torch.save({"_fsdp_shard_FSDP_SHARD_SEPARATOR_lin_FSDP_SHARD_SEPARATOR_weight": torch.zeros(2)},
               prefix + "_rank-x-of-y.pth")
    err = _refusal(tmp_path, capsys, "--ckpt_prefix", prefix)
    assert "_rank-x-of-y.pth is not a per-rank FSDP checkpoint: it holds a wrapped model's " \
        "shards ('_fsdp_shard_FSDP_SHARD_SEPARATOR_lin_FSDP_SHARD_SEPARATOR_weight') without the " \
        "shard metadata" \
        in err and "save_sharded(prefix, model, optimizer)" in err, err
    os.remove(prefix + "_rank-x-of-y.pth")


def test_refuses_mixed_sets(tmp_path, capsys):
    prefix = str(tmp_path / "ck")
    write_set(prefix, 2)
    write_set(str(tmp_path / "other"), 4)
    shutil.copy(tmp_path / "other_rank-00000003-of-00000004.pth",
                prefix + "_rank-00000003-of-00000004.pth")
    err = _refusal(tmp_path, capsys, "--ckpt_prefix", prefix)
    assert "different world sizes" in err and "world size 4" in err
    os.remove(prefix + "_rank-00000003-of-00000004.pth")
    # a rank file from a later save of the same model
    later = str(tmp_path / "later")
    write_set(later, 2, save_index=2)
    shutil.copy(later + "_rank-00000001-of-00000002.pth", prefix + "_rank-00000001-of-00000002.pth")
    err = _refusal(tmp_path, capsys, "--ckpt_prefix", prefix)
    assert "different saves" in err


def test_refuses_corrupted_and_truncated_files(tmp_path, capsys):
    prefix = str(tmp_path / "ck")
    paths = write_set(prefix, 2)
    with CheckpointFile(paths[1]) as f:
        key = f.tree["model"][next(iter(f.tree["model"]))].key
        offset = f._data_offset(key)
    data = bytearray(open(paths[1], "rb").read())
    data[offset + 3] ^= 0x40
    open(paths[1], "wb").write(bytes(data))
    err = _refusal(tmp_path, capsys, "--ckpt_prefix", prefix)
    assert paths[1] in err and "CRC-32" in err
    data[offset + 3] ^= 0x40
    open(paths[1], "wb").write(bytes(data[:len(data) // 2]))
    err = _refusal(tmp_path, capsys, "--ckpt_prefix", prefix)
    assert paths[1] in err and "truncated" in err


def test_a_step_directory_is_a_prefix(tmp_path, capsys):
    """A CheckpointManager's step directory names its one checkpoint; the output goes
    beside it. A manager's root, a DCP directory or a directory of several checkpoints
    gets the prefix to pass instead."""
    step = tmp_path / "ckpt" / "step000250"
    step.mkdir(parents=True)
    write_set(str(step / "checkpoint"), 2)
    code, out = _run(capsys, "--ckpt_prefix", str(step) + os.sep)
    assert code == 0, out.err
    result = torch.load(str(step) + "_consolidated.pth", weights_only=True)
    assert every(torch.equal(result["model"][k], v) for k, v in full_model().items())
    code, out = _run(capsys, "--ckpt_prefix", str(tmp_path / "ckpt"))
    assert code != 0 and f"e.g. {step}" in out.err, out.err
    write_set(str(step / "other"), 2)
    code, out = _run(capsys, "--ckpt_prefix", str(step))
    assert code != 0 and "several per-rank checkpoints" in out.err and "other" in out.err
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    code, out = _run(capsys, "--ckpt_prefix", str(dcp))
    assert code != 0 and "is a DCP checkpoint" in out.err, out.err


def test_a_prefix_is_a_path_not_a_pattern(tmp_path, capsys):
    """'run[1]/ck' names that directory; read as a glob it matched run1/ck, another save."""
    (tmp_path / "run[1]").mkdir()
    (tmp_path / "run1").mkdir()
    write_set(str(tmp_path / "run[1]" / "ck"), 2)
    write_set(str(tmp_path / "run1" / "ck"), 2, {k: v * 3 for k, v in full_model().items()})
    code, out = _run(capsys, "--ckpt_prefix", str(tmp_path / "run[1]" / "ck"))
    assert code == 0, out.err
    result = torch.load(tmp_path / "run[1]" / "ck_consolidated.pth", weights_only=True)
    assert every(torch.equal(result["model"][k], v) for k, v in full_model().items())


def test_safetensors_without_the_optimizer_removes_an_earlier_optimizer_file(tmp_path, capsys):
    """An earlier save's ``.optimizer.pth`` beside new weights would load with them."""
    prefix, out = str(tmp_path / "ck"), str(tmp_path / "m.safetensors")
    write_set(prefix, 2)
    assert _run(capsys, "--ckpt_prefix", prefix, "--format", "safetensors",
                "--save_path", out)[0] == 0
    assert (tmp_path / "m.optimizer.pth").exists()
    assert _run(capsys, "--ckpt_prefix", prefix, "--format", "safetensors", "--save_path",
                out, "--no_optimizer")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("m.")) == \
        ["m.safetensors"]


def test_entries_a_consolidated_checkpoint_does_not_carry_are_named(tmp_path, capsys):
    # Lightning Fabric's full save: its state's other keys beside the model in every rank file
    prefix = str(tmp_path / "ck")
    for path in write_set(prefix, 2, recipe=True):
        tree = torch.load(path, weights_only=True)
        torch.save(dict(tree, step=5, scheduler={"last_epoch": 5}), path)
    with pytest.warns(UserWarning, match=r"_rank-00000000-of-00000002.pth holds \['scheduler', "
                                         r"'step'\] beside the model, which a consolidated "
                                         r"checkpoint does not carry"):
        code, out = _run(capsys, "--ckpt_prefix", prefix)
    assert code == 0, out.err
