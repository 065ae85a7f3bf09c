"""Runs move between xla_fsdp and PyTorch's own FSDP2 through DCP, optimizer included.

Both sides train ``models.Net`` with AdamW on the same global batches from the same seeded
initial model: we at N = 4 virtual XLA devices, FSDP2 at M = 2 gloo CPU processes that
import neither torch_xla nor xla_fsdp (``support/fsdp2_side.py``, the standard recipe).
Each direction trains K steps, saves, and continues J steps on the saving side; the loading
side continues the same J steps from the checkpoint, and every loss must agree within 1e-5
relative. (The two implementations, trained from the same start, agree to about 1e-7.) Our
checkpoint reaches FSDP2 both ways: written by ``save_dcp`` from training code, and converted
offline from per-rank files by ``consolidate_sharded_ckpts --format dcp``; and under both key
schemes: the standard recipe's (``get_state_dict``) and torchtitan's checkpointer's (bare
model names, flattened optimizer; ``support/fsdp2_side.py`` loads as torchtitan does).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from xla_fsdp import launch
from xla_fsdp.checkpoint.consolidate import main as consolidate_main

from ...support.checks import nonempty, pairs
from ...support.models import GLOBAL_BATCH, Net, batch, loss_fn

K, J, WORLD, FSDP2_WORLD = 3, 3, 4, 2
SCHEMES = ("get_state_dict", "torchtitan")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
pytestmark = pytest.mark.slow


def _fsdp2(mode, a, b, out, targets):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT", "XLA"))}
    done = subprocess.run([sys.executable, "-m", "tests.support.fsdp2_side", mode, str(a),
                           str(b), out, str(FSDP2_WORLD)]
                          + [f"{recipe}={d}" for recipe, d in targets],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(out) as f:
        result = json.load(f)
    assert result["imported"] == [], result["imported"]
    return result["losses"]


def _steps(model, opt, rank, start, steps):
    import torch_xla
    import torch_xla.core.xla_model as xm
    local = GLOBAL_BATCH // WORLD
    losses = []
    for step in range(start, start + steps):
        x, y = batch("net", step)
        x = x[rank * local:(rank + 1) * local].to(torch_xla.device())
        y = y[rank * local:(rank + 1) * local].to(torch_xla.device())
        opt.zero_grad()
        loss = loss_fn("net", model(x), y)
        loss.backward()
        opt.step()
        mean = xm.all_reduce(xm.REDUCE_SUM, loss.detach(), scale=1.0 / WORLD)
        torch_xla.sync()
        losses.append(mean.item())
    return losses


def _model(seed):
    from xla_fsdp import FSDP
    torch.manual_seed(seed)
    model = Net()
    model.b1, model.b2 = FSDP(model.b1), FSDP(model.b2)
    model = FSDP(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _ours(rank, theirs, ours, prefix):
    from xla_fsdp.checkpoint import load_dcp, save_dcp, save_sharded
    out = {}
    for keys, directory in theirs.items():
        model, opt = _model(1)  # another start: only the checkpoint can make it continue alike
        load_dcp(directory, model, opt)
        out[f"continued_{keys}"] = _steps(model, opt, rank, K, J)
    model, opt = _model(0)
    _steps(model, opt, rank, 0, K)
    for keys, directory in ours.items():
        save_dcp(directory, model, opt, extra={"step": K}, keys=keys)
    save_sharded(prefix, model, opt, extra={"step": K})
    out["continued_ours"] = _steps(model, opt, rank, K, J)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    prefix = str(tmp / "ranks")
    dirs = {f"{side}_{keys}": str(tmp / f"{side}_{keys}")
            for side in ("fsdp2", "ours", "offline") for keys in SCHEMES}
    theirs = {k: dirs[f"fsdp2_{k}"] for k in SCHEMES}
    fsdp2_losses = _fsdp2("train_save", K, J, str(tmp / "fsdp2.json"), theirs.items())
    out = launch(_ours, (theirs, {k: dirs[f"ours_{k}"] for k in SCHEMES}, prefix),
                 num_devices=WORLD)[0]
    out["fsdp2_own"] = fsdp2_losses[K:]
    for keys in nonempty(SCHEMES, "key schemes"):
        assert consolidate_main(["--ckpt_prefix", prefix, "--format", "dcp", "--dcp_keys", keys,
                                 "--save_path", dirs[f"offline_{keys}"]]) == 0
    mine = [(k, dirs[f"{side}_{k}"]) for side in ("ours", "offline") for k in SCHEMES]
    continued = _fsdp2("continue", K, J, str(tmp / "fsdp2_continued.json"), mine)
    out.update((f"fsdp2_from_{side}_{k}", continued[dirs[f"{side}_{k}"]])
               for side in ("ours", "offline") for k in SCHEMES)
    out["dirs"] = dirs
    return out


def _close(got, want):
    assert len(got) == len(want) == J
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    print(f"losses {got} against {want}: largest relative difference {worst:.2e}")
    for step, (a, b) in enumerate(pairs(got, want, what="losses")):
        assert abs(a - b) <= 1e-5 * abs(b), (step, got, want)


@pytest.mark.parametrize("keys", SCHEMES)
def test_fsdp2_continues_from_our_checkpoint(runs, keys):
    _close(runs[f"fsdp2_from_ours_{keys}"], runs["continued_ours"])


@pytest.mark.parametrize("keys", SCHEMES)
def test_fsdp2_continues_from_our_per_rank_files_converted_offline(runs, keys):
    _close(runs[f"fsdp2_from_offline_{keys}"], runs["continued_ours"])


@pytest.mark.parametrize("keys", SCHEMES)
def test_we_continue_from_an_fsdp2_checkpoint(runs, keys):
    _close(runs[f"continued_{keys}"], runs["fsdp2_own"])


@pytest.mark.parametrize("side", ["ours", "offline"])
def test_dcp_to_torch_save_gives_the_unwrapped_state_dict(runs, tmp_path, side):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    names = [n for n, _ in Net().named_parameters()]
    for keys in nonempty(SCHEMES, "key schemes"):
        dcp_to_torch_save(runs["dirs"][f"{side}_{keys}"], str(tmp_path / f"{keys}.pt"))
        state = torch.load(tmp_path / f"{keys}.pt", weights_only=False)
        assert state.pop("extra") == {"step": K}
        if keys == "get_state_dict":
            Net().load_state_dict(state["model"], strict=True)
            assert state["optimizer"]["param_groups"][0]["params"] == names
            assert sorted(state["optimizer"]["state"]) == sorted(names)
        else:  # the model at the top level, the optimizer one level deep
            optimizer = state.pop("optimizer")
            Net().load_state_dict(state, strict=True)
            assert sorted(optimizer) == sorted(
                [f"state.{n}.{k}" for n in names for k in ("step", "exp_avg", "exp_avg_sq")]
                + [f"param_groups.{n}.{k}" for n in names
                   for k in torch.optim.AdamW([torch.zeros(1)]).defaults])
