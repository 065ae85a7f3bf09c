"""Save at N=4, consolidate, reshard to 2 and 8, resume; and consolidate torch_xla's own
checkpoints. One launch per world size; every check of that size runs inside it.

Bounds: SGD with momentum in fp32, as in the parity suite: parameters and momentum within
1e-5 of unsharded training, resumed losses within 1e-5 relative of continuing at N=4.
"""

import pytest
import torch

from xla_fsdp import launch
from xla_fsdp.checkpoint.consolidate import main as consolidate_main

from ..support.checkpoint_workloads import optimizer_for, train, wrapped_net
from ..support.models import Net

FIRST, THEN = range(0, 5), range(5, 10)


def at_four(rank, prefix, upstream_prefix):
    import torch_xla.runtime as xr
    from xla_fsdp.checkpoint import save_sharded
    world = xr.world_size()
    model = wrapped_net()
    opt = optimizer_for(model)
    train(model, opt, FIRST, rank, world)
    path = save_sharded(prefix, model, opt, extra={"step": 5})
    full = model.full_state_dict()
    continued = train(model, opt, THEN, rank, world)
    _save_upstream(rank, upstream_prefix)
    return {"path": path, "full": full, "continued": continued}


def _save_upstream(rank, prefix):
    """torch_xla's FSDP, checkpointed the way its documentation shows."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as UpstreamFSDP
    torch.manual_seed(1)
    model = Net()
    model.b1 = UpstreamFSDP(model.b1, flatten_parameters=True)
    model.b2 = UpstreamFSDP(model.b2, shard_param_on_dim_0=True)
    model = UpstreamFSDP(model)
    torch_xla.sync()
    state = {"model": xm._maybe_convert_to_cpu(model.state_dict()),
             "shard_metadata": model.get_shard_metadata()}
    torch.save(state, f"{prefix}_rank-{rank:08d}-of-{xr.world_size():08d}.pth")


def unsharded(rank):
    import torch_xla
    torch.manual_seed(0)
    model = Net().to(torch_xla.device())
    opt = optimizer_for(model)
    train(model, opt, FIRST, 0, 1)
    return {"params": {k: v.detach().cpu() for k, v in model.named_parameters()},
            "momentum": [opt.state[p]["momentum_buffer"].cpu() for p in model.parameters()]}


def resumed(rank, prefix, consolidated_path):
    import torch_xla.runtime as xr
    from xla_fsdp.checkpoint import load_sharded
    world = xr.world_size()
    model = wrapped_net()
    opt = optimizer_for(model)
    errors = {}
    try:  # the N=4 files, at this world size
        load_sharded(prefix.rsplit("_to", 1)[0], model, opt)
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        errors["world"] = str(exc)
    from xla_fsdp import FSDP
    try:  # the right world size, but a model wrapped differently
        load_sharded(prefix, FSDP(Net()), None)
    except Exception as exc:  # noqa: BLE001
        errors["wrapping"] = str(exc)
    extra = load_sharded(prefix, model, opt)
    losses = train(model, opt, THEN, rank, world)
    # a consolidated checkpoint seeds a model at any world size, and reads back unchanged
    seeded = wrapped_net()
    consolidated = torch.load(consolidated_path, weights_only=True)["model"]
    seeded.load_full_state_dict(consolidated)
    back = seeded.full_state_dict()
    same = rank != 0 or all(torch.equal(back[k], v) for k, v in consolidated.items())
    return {"extra": extra, "errors": errors, "losses": losses, "seeded_round_trip": same,
            "keys": sorted(back) == sorted(consolidated) if rank == 0 else True}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    prefix, upstream = str(root / "net"), str(root / "upstream")
    out = launch(at_four, (prefix, upstream), num_devices=4)
    consolidated = str(root / "net_consolidated.pth")
    assert consolidate_main(["--ckpt_prefix", prefix]) == 0
    return {"prefix": prefix, "upstream": upstream, "at_four": out,
            "consolidated": consolidated, "root": root}


def test_consolidated_matches_unsharded_training(saved):
    ref = launch(unsharded, num_devices=1)[0]
    ckpt = torch.load(saved["consolidated"], weights_only=True)
    plain = Net()
    plain.load_state_dict(ckpt["model"], strict=True)
    for name, value in ref["params"].items():
        assert (ckpt["model"][name] - value).abs().max() <= 1e-5, name
    # the optimizer state loads into an optimizer over the plain model and matches
    opt = optimizer_for(plain)
    opt.load_state_dict(ckpt["optimizer"])
    assert ckpt["optimizer_param_names"] == [n for n, _ in plain.named_parameters()]
    for p, expected in zip(plain.parameters(), ref["momentum"]):
        assert (opt.state[p]["momentum_buffer"] - expected).abs().max() <= 1e-5
    # the library's own gather agrees exactly with the file-based consolidation
    full = saved["at_four"][0]["full"]
    assert sorted(full) == sorted(ckpt["model"])
    assert all(torch.equal(full[k], v) for k, v in ckpt["model"].items())


def test_safetensors_equals_pt(saved):
    from safetensors.torch import load_file
    out = str(saved["root"] / "net.safetensors")
    assert consolidate_main(["--ckpt_prefix", saved["prefix"], "--format", "safetensors",
                             "--save_path", out]) == 0
    pt = torch.load(saved["consolidated"], weights_only=True)
    st = load_file(out)
    assert sorted(st) == sorted(pt["model"])
    assert all(torch.equal(st[k], v) for k, v in pt["model"].items())
    opt = torch.load(str(saved["root"] / "net.optimizer.pth"), weights_only=True)
    assert opt["optimizer_param_names"] == pt["optimizer_param_names"]


@pytest.mark.parametrize("world", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_reshard_and_resume(saved, world):
    target = f"{saved['prefix']}_to{world}"
    assert consolidate_main(["--ckpt_prefix", saved["prefix"], "--reshard", str(world),
                             "--save_path", target]) == 0
    out = launch(resumed, (target, saved["consolidated"]), num_devices=world)
    expected = saved["at_four"][0]["continued"]
    for rank, result in out.items():
        assert result["extra"] == {"step": 5}
        assert "reshard them with consolidate_sharded_ckpts" in result["errors"]["world"]
        assert f"--reshard {world}" in result["errors"]["world"]
        assert "sharded differently" in result["errors"]["wrapping"]
        assert result["seeded_round_trip"] and result["keys"]
        for step, (got, want) in enumerate(zip(result["losses"], expected)):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, step, got, want)


def test_consolidates_torch_xla_checkpoints(saved):
    from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints
    theirs, _ = consolidate_sharded_model_checkpoints(
        saved["upstream"], "_rank-*-of-*.pth", save_model=False)
    out = str(saved["root"] / "upstream_by_us.pth")
    assert consolidate_main(["--ckpt_prefix", saved["upstream"], "--save_path", out]) == 0
    ours = torch.load(out, weights_only=True)["model"]
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], v) for k, v in theirs.items())
    Net().load_state_dict(ours, strict=True)
