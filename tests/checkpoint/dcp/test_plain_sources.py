"""DCP checkpoints written without FSDP load too: a plain single-process ``dcp.save`` of
``model.state_dict()``, ``get_state_dict`` of the model and its AdamW, and the flattened
optimizer form torchtitan saves (``flatten_optimizer_state_dict=True``, next to state of its
own). Written here on the CPU, loaded at N = 2; training continued from each matches plain
PyTorch continuing (losses within 1e-5 relative)."""
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict)

from xla_fsdp import launch

from ...support.models import GLOBAL_BATCH, Net, batch, loss_fn

WORLD, BEFORE, AFTER = 2, 2, 2


def _plain_steps(model, opt, start, steps):
    losses = []
    for step in range(start, start + steps):
        x, y = batch("net", step)
        opt.zero_grad()
        loss = loss_fn("net", model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _ours(rank, directories):
    import torch_xla
    import torch_xla.core.xla_model as xm
    from xla_fsdp import FSDP
    from xla_fsdp.checkpoint import load_dcp
    out = {}
    for label, directory in directories.items():
        torch.manual_seed(1)
        model = Net()
        model.b1 = FSDP(model.b1, flatten_parameters=True)
        model = FSDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        load_dcp(directory, model, None if label == "model_only" else opt)
        out[label] = {"full": model.full_state_dict(rank0_only=False), "losses": []}
        if label == "model_only":
            continue
        local = GLOBAL_BATCH // WORLD
        for step in range(BEFORE, BEFORE + AFTER):
            x, y = batch("net", step)
            opt.zero_grad()
            loss = loss_fn("net", model(x[rank * local:(rank + 1) * local].to(torch_xla.device())),
                           y[rank * local:(rank + 1) * local].to(torch_xla.device()))
            loss.backward()
            opt.step()
            mean = xm.all_reduce(xm.REDUCE_SUM, loss.detach(), scale=1.0 / WORLD)
            torch_xla.sync()
            out[label]["losses"].append(mean.item())
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    _plain_steps(model, opt, 0, BEFORE)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    directories = {label: str(tmp / label) for label in ("model_only", "get_state_dict",
                                                         "torchtitan")}
    msd, osd = get_state_dict(model, opt)
    flat = get_optimizer_state_dict(model, opt,
                                    options=StateDictOptions(flatten_optimizer_state_dict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model.state_dict()}, checkpoint_id=directories["model_only"],
                 no_dist=True)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=directories["get_state_dict"],
                 no_dist=True)
        dcp.save({"model": get_model_state_dict(model), "optimizer": flat,
                  "train_state": {"step": BEFORE}}, checkpoint_id=directories["torchtitan"],
                 no_dist=True)
    assert any(".param_groups.b1.up.weight." in k for k in _keys(directories["torchtitan"]))
    return {"state": state, "losses": _plain_steps(model, opt, BEFORE, AFTER),
            "ours": launch(_ours, (directories,), num_devices=WORLD)}


def _keys(directory):
    return dcp.FileSystemReader(directory).read_metadata().state_dict_metadata


@pytest.mark.parametrize("label", ["model_only", "get_state_dict", "torchtitan"])
def test_plain_checkpoints_load_and_training_continues_alike(loaded, label):
    for rank, out in loaded["ours"].items():
        full = out[label]["full"]
        assert sorted(full) == sorted(loaded["state"])
        for key, value in loaded["state"].items():
            assert torch.equal(full[key], value), (rank, label, key)
        if label != "model_only":
            for a, b in zip(out[label]["losses"], loaded["losses"]):
                assert abs(a - b) <= 1e-5 * abs(b), (label, out[label]["losses"],
                                                     loaded["losses"])
