"""Every name we write agrees with ``state_dict()`` whatever wrappers sit between or inside
units (torch's checkpoint wrapper, ``torch.compile``'s ``_orig_mod``, PEFT's
``base_model.model``): torch_xla's recipe files and ours consolidate, the result loads
``strict=True`` into the unwrapped model, and files written before the fix still consolidate
(workloads in ``support/wrapper_workloads.py``)."""
import pytest
import torch

from xla_fsdp import launch
from xla_fsdp.checkpoint.consolidate.cli import main as consolidate

from ..support.checks import nonempty
from ..support.wrapper_workloads import CASES, WORLD, plain, save_cases


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
