"""``--format dcp``: per-rank files to a DCP directory in the layout ``get_state_dict`` +
``dcp.save`` write, read back with DCP's own ``dcp_to_torch_save`` (no XLA)."""
import os

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from xla_fsdp.checkpoint.consolidate import main

from ...support.synthetic_checkpoints import (SHAPES, full_model, stacked_full_model,
                                              stacked_names, write_set, write_stacked)
from ...support.checks import every, nonempty


def _convert(tmp_path, prefix, *extra):
    out = str(tmp_path / "dcp")
    assert main(["--ckpt_prefix", prefix, "--format", "dcp", "--save_path", out, *extra]) == 0
    assert ".metadata" in os.listdir(out)
    dcp_to_torch_save(out, str(tmp_path / "back.pt"))
    return torch.load(tmp_path / "back.pt", weights_only=False)


@pytest.mark.parametrize("recipe", [False, True])
def test_model_and_optimizer_by_name(tmp_path, recipe):
    """Our files, and files written with torch_xla's recipe (which record no optimizer
    mapping; an optimizer over the model's parameters() in order is recognised)."""
    write_set(str(tmp_path / "ck"), 3, recipe=recipe)
    back = _convert(tmp_path, str(tmp_path / "ck"))
    full = full_model()
    assert sorted(back["model"]) == sorted(SHAPES)
    for name in nonempty(SHAPES, "parameters"):
        assert torch.equal(back["model"][name], full[name])
        state = back["optimizer"]["state"][name]
        assert torch.equal(state["momentum_buffer"], full[name] * 0.5)
        assert float(state["step"]) == 7.0  # the same on every rank: stored per parameter
    (param_group,) = back["optimizer"]["param_groups"]
    assert param_group == {"lr": 0.1, "params": list(SHAPES)}


def test_flattened_and_stacked_groups_by_name(tmp_path):
    write_set(str(tmp_path / "flat"), 4, flattened=True)
    back = _convert(tmp_path, str(tmp_path / "flat"), "--no_optimizer")
    assert every(torch.equal(back["model"][n], full_model()[n]) for n in SHAPES)
    assert "optimizer" not in back
    (tmp_path / "dcp").rename(tmp_path / "dcp_flat")
    write_stacked(str(tmp_path / "stack"), 3, "interleaved", multiple=2)
    back = _convert(tmp_path, str(tmp_path / "stack"), "--no_optimizer")
    full = stacked_full_model()
    assert sorted(back["model"]) == sorted(stacked_names())
    assert every(torch.equal(back["model"][n], full[n]) for n in stacked_names())


def test_torchtitan_keys(tmp_path):
    """``--dcp_keys torchtitan``: the model at the top level under bare names, the optimizer
    flattened as ``flatten_optimizer_state_dict`` has it (``state.<name>.<key>``,
    ``param_groups.<name>.<setting>``)."""
    write_set(str(tmp_path / "ck"), 3)
    back = _convert(tmp_path, str(tmp_path / "ck"), "--dcp_keys", "torchtitan")
    optimizer = back.pop("optimizer")
    full = full_model()
    assert sorted(back) == sorted(SHAPES)
    assert every(torch.equal(back[n], full[n]) for n in SHAPES)
    assert sorted(optimizer) == sorted([f"state.{n}.{k}" for n in SHAPES
                                        for k in ("momentum_buffer", "step")]
                                       + [f"param_groups.{n}.lr" for n in SHAPES])
    for name in nonempty(SHAPES, "parameters"):
        assert torch.equal(optimizer[f"state.{name}.momentum_buffer"], full[name] * 0.5)
        assert optimizer[f"param_groups.{name}.lr"] == 0.1
