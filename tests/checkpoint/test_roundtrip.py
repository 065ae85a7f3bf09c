"""Save at N=4, consolidate, reshard to 2 and 8, resume; load the N=4 files at 2 and 8
directly, every layout, per-rank and DCP, and train on as unsharded training does; and
consolidate torch_xla's own checkpoints. One launch per world size; every check of that size
runs inside it.

Bounds: SGD with momentum in fp32, as in the parity suite: parameters and momentum within
1e-5 of unsharded training, resumed losses within 1e-5 relative of continuing at N=4. The
layouts' bounds (AdamW) are in ``support/any_world_workloads.py``.
"""

import os

import pytest
import torch

from xla_fsdp import launch
from xla_fsdp.checkpoint.consolidate import main as consolidate_main

from ..support import any_world_workloads as layouts
from ..support.checkpoint_workloads import optimizer_for, train, wrapped_net
from ..support.models import Net
from ..support.parity import paired
from ..support.checks import every, nonempty, pairs

pytestmark = pytest.mark.slow  # training, saving and resuming at N = 4 and 2 (8 too)

FIRST, THEN = range(0, 5), range(5, 10)


def at_four(rank, prefix, upstream_prefix, layouts_dir):
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
    return {"path": path, "full": full, "continued": continued,
            "layouts": layouts.save_layouts(rank, layouts_dir)}


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
            "momentum": [opt.state[p]["momentum_buffer"].cpu() for p in model.parameters()],
            "layouts": layouts.unsharded_layouts()}


def resumed(rank, prefix, consolidated_path, layouts_dir, upstream_prefix):
    import torch_xla.runtime as xr
    from xla_fsdp import FSDP
    from xla_fsdp.checkpoint import load_sharded
    world = xr.world_size()
    # the N=4 files themselves, at this world size
    direct = wrapped_net()
    direct_opt = optimizer_for(direct)
    direct_extra = load_sharded(prefix.rsplit("_to", 1)[0], direct, direct_opt)
    direct_losses = train(direct, direct_opt, THEN, rank, world)
    # the resharded files (this rank's own), and into a model wrapped differently
    model = wrapped_net()
    opt = optimizer_for(model)
    extra = load_sharded(prefix, model, opt)
    other = FSDP(Net())
    load_sharded(prefix, other, None)
    other_wrapping = other.full_state_dict(rank0_only=False)
    # torch_xla's own per-rank files (its recipe, model only), at this world size
    upstream = wrapped_net()
    load_sharded(upstream_prefix, upstream, None)
    upstream_state = upstream.full_state_dict(rank0_only=False)
    # the same files given to load_state_dict, as torch_xla's recipe resumes: refused
    theirs = torch.load(f"{upstream_prefix}_rank-{rank % 4:08d}-of-00000004.pth",
                        weights_only=False)["model"]
    try:
        upstream.load_state_dict(theirs, strict=False)
        upstream_direct = "loaded"
    except ValueError as exc:
        upstream_direct = str(exc)
    upstream_unchanged = every(torch.equal(v, upstream_state[k]) for k, v in
                               upstream.full_state_dict(rank0_only=False).items())
    losses = train(model, opt, THEN, rank, world)
    # a consolidated checkpoint seeds a model at any world size, and reads back unchanged
    seeded = wrapped_net()
    consolidated = torch.load(consolidated_path, weights_only=True)["model"]
    seeded.load_full_state_dict(consolidated)
    back = seeded.full_state_dict()
    same = rank != 0 or every(torch.equal(back[k], v) for k, v in consolidated.items())
    return {"stale": _over_another_world_size(rank, prefix.rsplit("_to", 1)[0], model, opt),
            "extra": extra, "losses": losses, "seeded_round_trip": same,
            "keys": sorted(back) == sorted(consolidated) if rank == 0 else True,
            "direct_extra": direct_extra, "direct_losses": direct_losses,
            "other_wrapping": every(torch.equal(other_wrapping[k], v)
                                    for k, v in consolidated.items()),
            "upstream": upstream_state, "upstream_direct": upstream_direct,
            "upstream_unchanged": upstream_unchanged,
            "layouts": layouts.resume_layouts(rank, layouts_dir)}


def _over_another_world_size(rank, four_prefix, model, opt):
    """A prefix holding this world size's files and, newer, the N=4 files (an earlier run at
    another size): no load picks one of the two saves; a save over it removes the N=4 ones."""
    import glob
    import shutil
    import torch_xla.core.xla_model as xm
    from xla_fsdp.checkpoint import CheckpointError, load_sharded, save_sharded
    prefix = four_prefix + "_stale"
    save_sharded(prefix, model, opt, extra={"step": "ours"})
    if rank == 0:
        for path in glob.glob(four_prefix + "_rank-*-of-00000004.pth"):
            shutil.copy(path, prefix + path[len(four_prefix):])
    xm.rendezvous("the N=4 files are beside ours")
    try:
        refused = f"loaded {load_sharded(prefix, model, opt)}"
    except CheckpointError as exc:
        refused = str(exc)
    xm.rendezvous("every rank tried")
    save_sharded(prefix, model, opt, extra={"step": "again"})
    left = sorted(os.path.basename(p) for p in glob.glob(prefix + "_rank-*.pth"))
    return {"refused": refused, "left": left, "extra": load_sharded(prefix, model, opt)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    prefix, upstream = str(root / "net"), str(root / "upstream")
    layouts_dir = str(root / "layouts")
    out = launch(at_four, (prefix, upstream, layouts_dir), num_devices=4)
    consolidated = str(root / "net_consolidated.pth")
    assert consolidate_main(["--ckpt_prefix", prefix]) == 0
    return {"prefix": prefix, "upstream": upstream, "at_four": out,
            "consolidated": consolidated, "root": root, "layouts_dir": layouts_dir}


@pytest.fixture(scope="module")
def reference():
    return launch(unsharded, num_devices=1)[0]


def test_consolidated_matches_unsharded_training(saved, reference):
    ref = reference
    ckpt = torch.load(saved["consolidated"], weights_only=True)
    plain = Net()
    plain.load_state_dict(ckpt["model"], strict=True)
    for name, value in nonempty(ref["params"].items(), "parameters"):
        assert (ckpt["model"][name] - value).abs().max() <= 1e-5, name
    # the optimizer state loads into an optimizer over the plain model and matches
    opt = optimizer_for(plain)
    opt.load_state_dict(ckpt["optimizer"])
    assert ckpt["optimizer_param_names"] == [n for n, _ in plain.named_parameters()]
    for p, expected in pairs(plain.parameters(), ref["momentum"]):
        assert (opt.state[p]["momentum_buffer"] - expected).abs().max() <= 1e-5
    # the library's own gather agrees exactly with the file-based consolidation
    full = saved["at_four"][0]["full"]
    assert sorted(full) == sorted(ckpt["model"])
    assert every(torch.equal(full[k], v) for k, v in ckpt["model"].items())


def test_safetensors_equals_pt(saved):
    from safetensors.torch import load_file
    out = str(saved["root"] / "net.safetensors")
    assert consolidate_main(["--ckpt_prefix", saved["prefix"], "--format", "safetensors",
                             "--save_path", out]) == 0
    pt = torch.load(saved["consolidated"], weights_only=True)
    st = load_file(out)
    assert sorted(st) == sorted(pt["model"])
    assert every(torch.equal(st[k], v) for k, v in pt["model"].items())
    opt = torch.load(str(saved["root"] / "net.optimizer.pth"), weights_only=True)
    assert opt["optimizer_param_names"] == pt["optimizer_param_names"]


@pytest.fixture(scope="module")
def resumes(saved):
    """The launch at each world size, once: the reshard test and the layouts' share it."""
    done = {}

    def at(world):
        if world not in done:
            target = f"{saved['prefix']}_to{world}"
            assert consolidate_main(["--ckpt_prefix", saved["prefix"], "--reshard", str(world),
                                     "--save_path", target]) == 0
            done[world] = launch(resumed, (target, saved["consolidated"], saved["layouts_dir"],
                                           saved["upstream"]), num_devices=world)
        return done[world]
    return at


WORLDS = [2, pytest.param(8, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world", WORLDS)
def test_reshard_and_resume(resumes, saved, world):
    out = resumes(world)
    expected = saved["at_four"][0]["continued"]
    for rank, result in nonempty(out.items(), "ranks"):
        assert result["extra"] == {"step": 5} and result["direct_extra"] == {"step": 5}
        stale = result["stale"]
        assert "mixes checkpoints of different world sizes" in stale["refused"], stale
        assert stale["left"] == [f"net_stale_rank-{r:08d}-of-{world:08d}.pth"
                                 for r in range(world)], stale
        assert stale["extra"] == {"step": "again"}
        assert result["seeded_round_trip"] and result["keys"] and result["other_wrapping"]
        assert "load_state_dict() got a state dict saved by torch_xla's FSDP (key '" in \
            result["upstream_direct"] and "_fpw_module" in result["upstream_direct"] and \
            "load_sharded(prefix, model, optimizer)" in result["upstream_direct"], \
            result["upstream_direct"]
        assert result["upstream_unchanged"]
        for losses in (result["losses"], result["direct_losses"]):
            for step, (got, want) in paired(losses, expected):
                assert abs(got - want) <= 1e-5 * abs(want), (rank, step, got, want)


@pytest.mark.parametrize("world", WORLDS)
def test_every_layout_resumes_at_another_world_size(resumes, saved, reference, world):
    """N=4 per-rank and DCP checkpoints of every layout, loaded at ``world`` straight from
    their files: the state saved exactly, then training as unsharded training goes on."""
    problems = layouts.check_resumed(saved["at_four"][0]["layouts"], reference["layouts"],
                                     resumes(world), world)
    assert not problems, "\n".join(problems)


def test_a_checkpoint_loads_into_another_wrapping(saved, reference):
    """At N = 4: flat shards into row blocks and back, trained on as unsharded training
    goes on; an interleaved (flattened) checkpoint into row blocks, the state saved."""
    problems = layouts.check_across(saved["at_four"], reference["layouts"])
    assert not problems, "\n".join(problems)
    # saved again from the other layout, the same state consolidates to the same output
    root = saved["layouts_dir"]
    for name in nonempty(layouts.ACROSS, "layouts loaded across"):
        for fmt in ("pt", "safetensors", "dcp"):
            outputs = []
            for prefix in (name, name + "_across"):
                out = os.path.join(root, f"{prefix}.{fmt}")
                assert consolidate_main(["--ckpt_prefix", os.path.join(root, prefix),
                                         "--format", fmt, "--save_path", out]) == 0
                outputs.append(_output(fmt, out))
            assert outputs[0] == outputs[1], (name, fmt)
    at_four = saved["at_four"]
    for rank, result in nonempty(at_four.items(), "ranks"):
        got = result["layouts"]["flattened_into_dim0"]
        assert got["extra"] == {"layout": "flattened"}
        want = at_four[0]["layouts"]["flattened"]
        assert got["state"].keys() == want.keys()
        for key, value in nonempty(want.items(), "state entries"):
            assert got["state"][key].dtype == value.dtype, key
            assert torch.equal(got["state"][key], value), (rank, key)


def _output(fmt, path):
    """What a consolidated output holds, comparable with ``==``: a safetensors file's bytes
    (and its optimizer file's contents); a torch.save file's contents, tensors as bytes
    with their dtypes and shapes (each save has a random serialization id, and the pickle
    depends on which strings are the same object); a DCP directory's data files' bytes and
    its metadata, less the save's random id and path."""
    import pickle

    def plain(x):
        if isinstance(x, torch.Tensor):
            return str(x.dtype), tuple(x.shape), x.reshape(-1).view(torch.uint8).numpy().tobytes()
        if isinstance(x, dict):
            return [(k, plain(v)) for k, v in x.items()]
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    if fmt == "pt":
        return plain(torch.load(path, weights_only=True))
    if fmt == "safetensors":
        with open(path, "rb") as f:
            model = f.read()
        return model, plain(torch.load(path[:-len(".safetensors")] + ".optimizer.pth",
                                       weights_only=True))
    with open(os.path.join(path, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    data = []
    for name in sorted(n for n in os.listdir(path) if n.endswith(".distcp")):
        with open(os.path.join(path, name), "rb") as f:
            data.append(f.read())
    return data, meta.state_dict_metadata, meta.planner_data


def test_bad_per_rank_checkpoints_are_refused_and_change_nothing(resumes):
    for rank, result in nonempty(resumes(2).items(), "ranks"):
        out = result["layouts"]["refusals"]
        for label, message in out.items():
            print(f"rank {rank} {label}: {message}")
        assert "does not hold this model" in out["other_model"]
        assert "flattened_rank-*-of-*.pth" in out["other_model"]
        assert "unexpected ['b2.seen', 'head.bias', 'inp.bias', 'inp.weight']" \
            in out["other_model"]
        assert "ranks [3] are missing" in out["missing_rank"]
        for label in ("other_class", "other_class_subset"):
            assert "own_at_2_rank-*-of-*.pth" in out[label] and \
                "another optimizer class" in out[label], out[label]
        extras = result["layouts"]["own_extras"]
        assert extras["own"] == extras["replicas"] == ({"rank": rank}, {"rank": rank}), extras
        assert extras["common"] == ({"step": 3}, {"step": 3}), extras
        assert extras["common_dcp_keys"] == ["extra"], extras
        for message in nonempty(extras["into_groups"], "loads"):
            assert f"_group-{rank:03d})" in message and "was saved without " \
                "independent sharding_groups, and this model has them" in message, message
        assert "corrupt_rank-00000001-of-00000004.pth" in out["corrupt"]
        assert "CRC-32" in out["corrupt"]
        assert "nope: no such checkpoint" in out["no_checkpoint"]
        assert out["unchanged"] == [True, True]


def test_consolidates_torch_xla_checkpoints(saved, resumes):
    from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints
    theirs, _ = consolidate_sharded_model_checkpoints(
        saved["upstream"], "_rank-*-of-*.pth", save_model=False)
    out = str(saved["root"] / "upstream_by_us.pth")
    assert consolidate_main(["--ckpt_prefix", saved["upstream"], "--save_path", out]) == 0
    ours = torch.load(out, weights_only=True)["model"]
    assert sorted(ours) == sorted(theirs)
    assert every(torch.equal(ours[k], v) for k, v in theirs.items())
    Net().load_state_dict(ours, strict=True)
    # load_sharded reads them too, at another world size and into our wrapping
    for rank, result in nonempty(resumes(2).items(), "ranks"):
        assert sorted(result["upstream"]) == sorted(theirs)
        assert every(torch.equal(result["upstream"][k], v) for k, v in theirs.items()), rank
