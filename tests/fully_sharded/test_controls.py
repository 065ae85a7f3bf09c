"""The explicit controls, read off the traced step graph (one launch at N = 2): prefetching
moves a unit's all-gather ahead of the previous unit's compute, a unit grouping two modules
gathers both in one all-gather and leaves the root nothing, and unshard / reshard /
set_reshard_after_forward / set_reshard_after_backward gather exactly when they say.
Training parity with every control on is in the parity settings ("controls").
"""
import torch
import torch.nn as nn

from xla_fsdp import launch
from xla_fsdp.checkpoint.consolidate import main as consolidate_main

from ..support.hlo import ancestors, entry, find, traced_hlo
from ..support.checks import every

WORLD, BATCH = 2, 4
DIMS = [16, 24, 40, 56, 8]  # distinct, so each layer's tensors have shapes of their own


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(DIMS, DIMS[1:]))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _weight(i):
    return f"f32[{DIMS[i] * DIMS[i + 1]}]"  # layer i's gathered weight (flat)


def _wrap(prefetch):
    """layers 1 and 2 are units; layers 0 and 3 are one unit together; the root holds none."""
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    model = Chain()
    layers = model.layers
    ends = FSDP([layers[0], layers[3]], coalesce_all_gather_ops=True)
    layers[1], layers[2] = FSDP(layers[1]), FSDP(layers[2])
    root = FSDP(model)
    if prefetch:
        layers[1].set_modules_to_forward_prefetch([layers[2]])
        layers[2].set_modules_to_backward_prefetch([layers[1]])
    return root, ends


def _step_hlo(root, x):
    loss = root(x).sum()
    loss.backward()
    return traced_hlo([loss] + [p.grad for p in root.parameters()])


def controls(rank, prefix):
    import torch_xla
    device = torch_xla.device()
    x = torch.randn(BATCH, DIMS[0]).to(device)
    out = {}
    for prefetch in (False, True):
        root, ends = _wrap(prefetch)
        out[f"step_prefetch_{prefetch}"] = _step_hlo(root, x)
        out["root_params"] = [n for n, _ in root.named_parameters(recurse=False)]
        out["ends_names"] = sorted(n for n, _ in ends.get_original_names_and_sharded_parameters())
        torch_xla.sync()

    root, _ = _wrap(False)
    layer = root.module.layers[1]
    full = root.full_state_dict(rank0_only=False)
    names = [n for n in full if n.startswith("layers.1.")]
    layer.unshard()
    torch_xla.sync()
    out["unshard_values"] = every(torch.equal(getattr(layer.module, n.split(".")[-1]).cpu(),
                                              full[n]) for n in names)
    out["forward_after_unshard"] = traced_hlo([root(x)])
    layer.reshard()
    out["after_reshard"] = (layer.has_full_params, layer.module.weight.numel())
    torch_xla.sync()

    layer.set_reshard_after_forward(False)
    out["step_no_reshard_after_forward"] = _step_hlo(root, x)
    torch_xla.sync()
    layer.set_reshard_after_forward(True)
    layer.set_reshard_after_backward(False)
    opt = torch.optim.SGD(root.parameters(), lr=0.1, foreach=True)
    _step_hlo(root, x)
    torch_xla.sync()
    out["kept_after_backward"] = layer.has_full_params
    out["forward_kept"] = traced_hlo([root(x)])
    torch_xla.sync()
    opt.step()
    out["forward_after_step"] = traced_hlo([root(x)])
    torch_xla.sync()
    _checkpoint(out, root, opt, prefix, x)
    return out


def _checkpoint(out, root, opt, prefix, x):
    """A model with a grouping unit saves, resumes and consolidates under its plain names."""
    from xla_fsdp.checkpoint import load_sharded, save_sharded
    out["saved_full"] = root.full_state_dict(rank0_only=False)
    save_sharded(prefix, root, opt)
    fresh, _ = _wrap(False)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, foreach=True)
    load_sharded(prefix, fresh, fresh_opt)
    loaded = fresh.full_state_dict(rank0_only=False)
    out["loaded_equal"] = sorted(loaded) == sorted(out["saved_full"]) and every(
        torch.equal(loaded[k], v) for k, v in out["saved_full"].items())


def _gathers_of(step, i):
    """The all-gathers that carry layer i's weight: alone, or with the rest of its unit in
    one (a unit's flat pieces go out together, unpinned)."""
    w = _weight(i) + "{"
    return [(pos, ins) for pos, ins in find(step, "all-gather")
            if ins.type.startswith(w) or ins.type.startswith("(") and w in ins.type]


def _gathers(hlo, i):
    return len(_gathers_of(entry(hlo), i))


def test_controls(tmp_path):
    prefix = str(tmp_path / "chain")
    out = launch(controls, (prefix,), num_devices=WORLD)[0]
    layer1_output = f"f32[{BATCH},{DIMS[2]}]"  # layer 1's forward dot, layer 2's input grad
    for prefetch in (False, True):
        step = entry(out[f"step_prefetch_{prefetch}"])
        # forward: layer 2's gather against layer 1's compute
        (pos_gather, gather), _ = _gathers_of(step, 2)
        pos_dot, dot = find(step, "dot", layer1_output)[0]
        depends = dot.name in ancestors(step, gather.name)
        assert (pos_gather < pos_dot and not depends) if prefetch else depends, (prefetch,)
        # backward: layer 1's second gather against layer 2's backward compute
        _, (pos_gather, gather) = _gathers_of(step, 1)
        pos_dot, dot = find(step, "dot", layer1_output)[-1]
        depends = dot.name in ancestors(step, gather.name)
        assert (pos_gather < pos_dot and not depends) if prefetch else depends, (prefetch,)
        # each unit's gradients are reduce-scattered as its backward ends (collectives are
        # chained in issue order), not all at the end of backward: without prefetch, layer
        # 2's come before layer 1's backward gather, in the first step of a fresh model too
        (pos_reduce, _), = find(step, "reduce-scatter", f"f32[{DIMS[2] * DIMS[3] // WORLD}]")
        assert prefetch or pos_reduce < pos_gather, (pos_reduce, pos_gather)

        # the grouped unit: one all-gather carries layer 0 and layer 3, forward and backward
        both = [ins.type for _, ins in find(step, "all-gather", "(")
                if _weight(0) in ins.type and _weight(3) in ins.type]
        assert len(both) == 2, both
        assert every(_weight(3) in ins.type for _, ins in _gathers_of(step, 0))  # never alone
    assert out["root_params"] == []
    assert out["ends_names"] == ["layers.0.bias", "layers.0.weight",
                                 "layers.3.bias", "layers.3.weight"]

    assert out["unshard_values"]
    assert _gathers(out["forward_after_unshard"], 1) == 0
    assert out["after_reshard"] == (False, 0)
    assert _gathers(out["step_no_reshard_after_forward"], 1) == 1  # 2 by default
    assert _gathers(out["step_prefetch_False"], 1) == 2
    assert out["kept_after_backward"]
    assert _gathers(out["forward_kept"], 1) == 0
    # a foreach optimizer step changed the shard: the kept full weight is stale
    assert _gathers(out["forward_after_step"], 1) == 1

    assert out["loaded_equal"]
    assert consolidate_main(["--ckpt_prefix", prefix]) == 0
    consolidated = torch.load(prefix + "_consolidated.pth", weights_only=True)["model"]
    assert sorted(consolidated) == sorted(out["saved_full"])
    assert every(torch.equal(consolidated[k], v) for k, v in out["saved_full"].items())
