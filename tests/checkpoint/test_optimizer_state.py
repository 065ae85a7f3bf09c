"""``optimizer_state``'s rules for a saved param group's settings and for the state of a
shard stored per parameter (no XLA)."""
import pytest
import torch

from xla_fsdp.checkpoint.files import CheckpointError
from xla_fsdp.checkpoint.optimizer_state import (holds_settings_of, saved_state_dict,
                                                 shard_state_is_sharded)


def test_a_group_of_the_same_class_holds_its_settings_after_a_load():
    # torch's load_state_dict gives Adafactor's and LBFGS's defaults a ``differentiable``
    # their groups never hold: a second load into the same optimizer was refused as one
    # saved from another class
    for cls in (torch.optim.Adafactor, torch.optim.LBFGS, torch.optim.AdamW):
        opt = cls([torch.nn.Parameter(torch.zeros(2))])
        saved = opt.state_dict()["param_groups"][0]
        opt.load_state_dict(opt.state_dict())
        assert holds_settings_of(opt, saved), cls.__name__


def test_a_group_of_another_class_does_not():
    params = [torch.nn.Parameter(torch.zeros(2))]
    sgd = torch.optim.SGD(params, lr=0.1).state_dict()["param_groups"][0]
    assert not holds_settings_of(torch.optim.AdamW(params), sgd)
    assert holds_settings_of(torch.optim.SGD(params, lr=0.1), sgd)


def test_a_shards_parameters_are_sharded_alike_or_refused():
    w, b = (4, 3), (4,)
    moments = [("w.exp_avg", torch.zeros(w), w), ("b.exp_avg", torch.zeros(b), b)]
    steps = [("w.step", torch.tensor(1.0), w), ("b.step", torch.tensor(1.0), b)]
    assert shard_state_is_sharded("ck", "exp_avg", moments)
    assert not shard_state_is_sharded("ck", "step", steps)
    with pytest.raises(CheckpointError, match=r"^ck: optimizer state b.step is laid out "
                                              r"otherwise than w.exp_avg"):
        shard_state_is_sharded("ck", "exp_avg", [moments[0], steps[1]])


def test_a_saved_param_group_tells_another_optimizer_class_apart():
    """AdamW's groups hold every setting Adamax has, and ``amsgrad``, which Adamax lacks: saved
    from another class. A setting this optimizer's own groups hold is its own, though not one
    of its defaults (Hugging Face's Trainer gives every group a ``weight_decay``)."""
    import torch
    from xla_fsdp.checkpoint.optimizer_state import holds_settings_of
    p = [torch.zeros(2, 2, requires_grad=True)]
    adamw = torch.optim.AdamW(p).state_dict()["param_groups"][0]
    assert holds_settings_of(torch.optim.AdamW(p), adamw)
    assert not holds_settings_of(torch.optim.Adamax(p), adamw)
    rprop = torch.optim.Rprop([{"params": p, "weight_decay": 0.0}])
    assert holds_settings_of(rprop, rprop.state_dict()["param_groups"][0])


def test_a_state_dict_hook_may_change_settings_but_not_renumber_the_tensors():
    # every save ties an index to a shard by the live param_groups' order: a hook that
    # renumbered them would give one tensor's state another's name
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (2, 3, 4))
    sgd = torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=0.1)
    sgd.register_state_dict_post_hook(
        lambda _, saved: saved["param_groups"][1].update(lr=0.25))
    assert [g["lr"] for g in saved_state_dict(sgd)["param_groups"]] == [0.1, 0.25]
    sgd.register_state_dict_post_hook(
        lambda _, saved: saved["param_groups"][0].update(params=[1, 0]))
    with pytest.raises(CheckpointError, match=r"SGD.state_dict\(\) numbers the tensors .*"
                                              r"group 0: \[1, 0\], where torch numbers "
                                              r"\[0, 1\]"):
        saved_state_dict(sgd)
