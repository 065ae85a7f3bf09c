"""Every name we write agrees with ``state_dict()`` whatever wrappers sit between or inside
units (torch's checkpoint wrapper, ``torch.compile``'s ``_orig_mod``, PEFT's
``base_model.model``): torch_xla's recipe files and ours consolidate, the result loads
``strict=True`` into the unwrapped model, and files written before the fix still consolidate
(workloads in ``support/wrapper_workloads.py``). A grouped unit also kept as an attribute of
the model is named from where the root attached it, with its optimizer state."""
import pytest
import torch

from xla_fsdp import launch
from xla_fsdp.checkpoint.consolidate.cli import main as consolidate

from ..support.checks import nonempty
from ..support.wrapper_workloads import (CASES, GROUPED_KEPT, WORLD, Chain, grouped_kept, plain,
                                         save_cases)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("wrappers")
    return directory, launch(save_cases, (str(directory),), num_devices=WORLD)


@pytest.mark.parametrize("case", CASES)
def test_shard_metadata_names_the_state_dict_keys(saved, case):
    _, results = saved
    got = results[0][case]
    missing = [k for k in got["metadata_keys"] if k not in got["state_keys"]]
    assert not missing, missing


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("files", ["recipe", "ours", "old"])
def test_consolidates_and_loads_strictly(saved, case, files, tmp_path):
    directory, results = saved
    out = str(tmp_path / "full.pth")
    assert consolidate(["--ckpt_prefix", str(directory / f"{case}-{files}"),
                        "--save_path", out]) == 0
    state = torch.load(out, weights_only=True)["model"]
    model = plain(case)
    model.load_state_dict(state, strict=True)
    full = results[0][case]["full"]
    assert sorted(full) == sorted(model.state_dict())
    for k, v in nonempty(full.items(), "state entries"):
        assert torch.equal(state[k], v), k


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grouped")
    return directory, launch(grouped_kept, (str(directory),), num_devices=WORLD)[0]


@pytest.mark.parametrize("where", GROUPED_KEPT)
def test_a_grouped_unit_kept_under_a_second_name_saves_as_the_unwrapped_model(kept, where,
                                                                              tmp_path):
    directory, results = kept
    want = sorted(Chain().state_dict())
    assert results[where]["full"] == want
    # the per-rank files consolidate with the optimizer, named as the unwrapped model is
    out = str(tmp_path / "full.pth")
    assert consolidate(["--ckpt_prefix", str(directory / f"grouped-{where}"),
                        "--save_path", out]) == 0
    for path in nonempty([out] + (results[where]["consolidated"] or []), "consolidated files"):
        saved = torch.load(path, weights_only=True)
        Chain().load_state_dict(saved["model"], strict=True)
        assert sorted(saved["optimizer_param_names"]) == want, path
