"""DCP checkpoints written without FSDP load too: a plain single-process ``dcp.save`` of
``model.state_dict()``, ``get_state_dict`` of the model and its AdamW, and what torchtitan's
checkpointer writes: the model's entries at the top level under their bare names, the
optimizer flattened (``flatten_optimizer_state_dict=True``), next to state of its own
(``train_state``, ``lr_scheduler``, ``dataloader``); and its model-only seed checkpoint (bare
names, nothing else). Written here on the CPU, loaded at N = 2; training continued from each
matches plain PyTorch continuing (losses within 1e-5 relative)."""
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict)

from xla_fsdp import launch

from ...support.checks import nonempty
from ...support.models import GLOBAL_BATCH, Net, batch, loss_fn
from ...support.parity import paired

WORLD, BEFORE, AFTER = 2, 2, 2
LABELS = ("model_only", "get_state_dict", "torchtitan", "torchtitan_seed")
MODEL_ONLY = ("model_only", "torchtitan_seed")
REFUSED = ("deeper", "mixed_state")


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
    from xla_fsdp.checkpoint import CheckpointError, load_dcp
    out = {}
    for label, directory in directories.items():
        torch.manual_seed(1)
        model = Net()
        model.b1 = FSDP(model.b1, flatten_parameters=True)
        model = FSDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        if label in REFUSED:
            try:
                load_dcp(directory, model, opt if label == "mixed_state" else None)
            except CheckpointError as exc:
                out[label] = str(exc)
            continue
        load_dcp(directory, model, None if label in MODEL_ONLY else opt)
        out[label] = {"full": model.full_state_dict(rank0_only=False), "losses": []}
        if label in MODEL_ONLY:
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
    directories = {label: str(tmp / label) for label in LABELS + REFUSED}
    msd, osd = get_state_dict(model, opt)
    flat = get_optimizer_state_dict(model, opt,
                                    options=StateDictOptions(flatten_optimizer_state_dict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model.state_dict()}, checkpoint_id=directories["model_only"],
                 no_dist=True)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=directories["get_state_dict"],
                 no_dist=True)
        dcp.save(dict(get_model_state_dict(model), optimizer=flat,
                      train_state={"step": torch.tensor(BEFORE)}, lr_scheduler={"last_epoch": 1},
                      dataloader={"position": 7}),
                 checkpoint_id=directories["torchtitan"], no_dist=True)
        dcp.save(get_model_state_dict(model), checkpoint_id=directories["torchtitan_seed"],
                 no_dist=True)
        dcp.save(dict(get_model_state_dict(model), **{"b2.extra.weight": torch.ones(2)}),
                 checkpoint_id=directories["deeper"], no_dist=True)
        # one parameter of the flattened unit b1 with a moment of no shape, its neighbour's
        # shaped as its parameter: the shard's state cannot be both
        mixed = {k: dict(v) for k, v in osd["state"].items()}
        mixed["b1.down.bias"]["exp_avg"] = torch.zeros(())
        dcp.save({"model": msd, "optimizer": dict(osd, state=mixed)},
                 checkpoint_id=directories["mixed_state"], no_dist=True)
    keys = _keys(directories["torchtitan"])
    assert "b1.up.weight" in keys and "optimizer.param_groups.b1.up.weight.lr" in keys
    return {"state": state, "losses": _plain_steps(model, opt, BEFORE, AFTER),
            "ours": launch(_ours, (directories,), num_devices=WORLD)}


def _keys(directory):
    return dcp.FileSystemReader(directory).read_metadata().state_dict_metadata


@pytest.mark.parametrize("label", LABELS)
def test_plain_checkpoints_load_and_training_continues_alike(loaded, label):
    for rank, out in nonempty(loaded["ours"].items(), "ranks"):
        full = out[label]["full"]
        assert sorted(full) == sorted(loaded["state"])
        for key, value in nonempty(loaded["state"].items(), "state entries"):
            assert torch.equal(full[key], value), (rank, label, key)
        if label not in MODEL_ONLY:  # a seed checkpoint has no optimizer to train on with
            for _, (a, b) in paired(out[label]["losses"], loaded["losses"]):
                assert abs(a - b) <= 1e-5 * abs(b), (label, out[label]["losses"],
                                                     loaded["losses"])


def test_optimizer_state_laid_out_two_ways_in_one_shard_is_refused_naming_it(loaded):
    for rank, out in nonempty(loaded["ours"].items(), "ranks"):
        assert "optimizer.state.b1.down.bias.exp_avg is laid out otherwise" in \
            out["mixed_state"], out["mixed_state"]


def test_a_bare_checkpoint_of_another_model_is_refused_naming_the_key(loaded):
    for rank, out in nonempty(loaded["ours"].items(), "ranks"):
        assert "torchtitan's keys" in out["deeper"] and "b2.extra.weight" in out["deeper"], \
            out["deeper"]
