"""Which shard each saved optimizer index holds, the one rule for what optimizer state is
sharded like its tensor (``optimizer_state.state_is_sharded``), the one walk that applies it to a
live optimizer or a saved state dict (``optimizer_state.walk_state``), and the one walk of per-rank
files' state by parameter name that every output of them takes (``named_state``). No XLA."""
import pytest
import torch

from xla_fsdp.checkpoint.formats.dcp.layout import GET_STATE_DICT
from xla_fsdp.checkpoint.files import CheckpointError
from xla_fsdp.checkpoint.optimizer_state import live_state, state_is_sharded, walk_state
from xla_fsdp.checkpoint.per_rank.optimizer import named_state, optimizer_param_keys
from xla_fsdp.checkpoint.per_rank.plan import plan_model
from xla_fsdp.checkpoint.per_rank.shard_set import find_shard_set
from xla_fsdp.checkpoint.formats.keys import OPTIMIZER

from ...support.checks import every, nonempty
from ...support.synthetic_checkpoints import SHAPES, full_model, shard_key, write_set


def _with_plan(prefix, fn):
    shards = find_shard_set(prefix, "_rank-*-of-*.pth", verify=False)
    try:
        return fn(shards, plan_model(shards))
    finally:
        shards.close()


def _keys(prefix):
    return _with_plan(prefix, optimizer_param_keys)


def test_torch_xla_recipe_files_are_read_in_parameter_order_unless_a_state_says_otherwise(
        tmp_path):
    prefix = str(tmp_path / "ckpt")
    paths = write_set(prefix, 2, recipe=True)   # no record of which shard an index holds
    keys, reason = _keys(prefix)
    assert reason is None and keys == [shard_key(n) for n in SHAPES]
    # an optimizer built over the parameters in another order: index 0's momentum has the
    # bias shard's shape, not the weight shard's
    tree = torch.load(paths[1], weights_only=False)
    state = tree[OPTIMIZER]["state"]
    state[0], state[1] = state[1], state[0]
    torch.save(tree, paths[1])
    keys, reason = _keys(prefix)
    assert reason.startswith("the optimizer was not built over model.parameters() in order"), \
        reason
    assert (f"{paths[1]}: optimizer index 0 (shard {shard_key('lin.weight')}): optimizer state "
            f"'momentum_buffer' has shape [3], neither its tensor's [8]") in reason, reason



def test_an_optimizer_holding_a_shard_left_out_of_the_files_is_not_read(tmp_path):
    """The model's shard left out of every rank file (a save's filter), the optimizer's
    state for it kept: the optimizer cannot be consolidated, and says why (see [Note: shards
    left out of every rank file])."""
    prefix = str(tmp_path / "ckpt")
    for path in write_set(prefix, 2):     # save_sharded's record of each index's shard
        tree = torch.load(path, weights_only=False)
        del tree["model"][shard_key("lin.bias")]
        torch.save(tree, path)
    keys, reason = _keys(prefix)
    assert keys is None and reason.endswith(
        f"the optimizer holds the state of shard {shard_key('lin.bias')}, which the rank "
        f"files do not hold (left out when saving)"), reason

def test_one_rule_for_state_sharded_like_its_tensor():
    shard = torch.zeros(8)
    assert state_is_sharded("w", "exp_avg", torch.zeros(8), shard.shape)
    assert not state_is_sharded("w", "step", torch.tensor(3.0), shard.shape)
    assert not state_is_sharded("w", "lr_scale", 0.5, shard.shape)           # not a tensor
    # a 0-d parameter's step count has its shape but is not cut as the parameter is
    assert not state_is_sharded("s", "step", torch.tensor(1.0), ())
    assert state_is_sharded("s", "exp_avg", torch.tensor(1.0), ())
    with pytest.raises(CheckpointError, match=r"^f.pth, index 2: optimizer state 'row_var' "
                                              r"has shape \[2\], neither its tensor's \[8\]"):
        state_is_sharded("f.pth, index 2", "row_var", torch.zeros(2), shard.shape)


def test_one_walk_over_a_live_optimizer_or_its_state_dict():
    weight, bias, frozen = (torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2)),
                            torch.nn.Parameter(torch.ones(3)))
    optimizer = torch.optim.Adam([{"params": [weight]}, {"params": [frozen, bias]}])
    weight.grad, bias.grad = torch.ones(4), torch.ones(2)   # frozen gets no state
    optimizer.step()
    params, state = live_state(optimizer)
    assert params == [weight, frozen, bias] and sorted(state) == [0, 2]
    assert frozen not in optimizer.state   # looking did not add it
    assert state[0]["exp_avg"] is optimizer.state[weight]["exp_avg"]   # nothing copied

    def walked(by_index):
        return [(v.index, v.name, v.sharded) for v in
                walk_state(by_index, lambda i: params[i].shape, lambda i: f"index {i}")]
    want = [(i, n, n != "step") for i in (0, 2) for n in ("step", "exp_avg", "exp_avg_sq")]
    assert walked(state) == want
    assert walked(optimizer.state_dict()["state"]) == want   # the saved form walks alike
    assert walked({2: state[2]}) == want[3:]
    optimizer.state[bias]["exp_avg_sq"] = torch.ones(1)   # statistics over a shard's rows
    with pytest.raises(CheckpointError, match=r"^index 2: optimizer state 'exp_avg_sq'"):
        walked(state)


def test_the_named_walk_reads_a_shared_shard_state_by_state_and_both_forms_agree(tmp_path):
    prefix = str(tmp_path / "ckpt")
    write_set(prefix, 2, flattened=True)   # both parameters in one shard, one optimizer index
    full = full_model()
    names = list(SHAPES)

    def walk(shards, plan):
        named = named_state(shards, plan)
        order = [(p, n, v.read()) for p, n, v in named.in_read_order()]
        added = []
        optimizer, index_names = named.as_indexed_state_dict(lambda t: added.append(t) or t)
        return named, order, added, optimizer, index_names
    named, order, added, optimizer, index_names = _with_plan(prefix, walk)
    # the shard's momentum for both parameters (one gather, live), then their step counts
    assert [(p, n) for p, n, _ in order] == [(names[0], "momentum_buffer"),
                                             (names[1], "momentum_buffer"),
                                             (names[0], "step"), (names[1], "step")]
    for p, n, value in nonempty(order, "states read"):
        want = full[p] * 0.5 if n == "momentum_buffer" else torch.tensor(7.0)
        assert torch.equal(value, want), (p, n)
    assert named.shard == {n: shard_key("flat_param_0") for n in names}
    assert [(k, v) for k, _, v in named.param_group_entries(GET_STATE_DICT)] == [
        ("optimizer.param_groups.0.lr", 0.1), ("optimizer.param_groups.0.params", names)]
    # the consolidated form: the same state by index, tensors added in the walk's order
    assert index_names == names and optimizer["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert [t.shape for t in added] == [torch.Size(SHAPES[p]) if n == "momentum_buffer"
                                        else torch.Size([]) for p, n, _ in order]
    assert every(torch.equal(optimizer["state"][names.index(p)][n], v) for p, n, v in order)
