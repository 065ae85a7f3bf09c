"""``UnwrappedState``, what every consolidated writer reads, and the one rule naming a sharded
optimizer's state (``named_state``), both producers' (per-rank files, a live model). No XLA."""
import torch

from xla_fsdp.checkpoint.formats.dcp.layout import GET_STATE_DICT
from xla_fsdp.checkpoint.unwrapped_state import UnwrappedState, holding, named_state


class _Lazy:
    """A readable that records its reads."""

    def __init__(self, name, reads, shape=(2,)):
        self.name, self.reads, self.shape, self.dtype = name, reads, shape, torch.float32

    def read(self):
        self.reads.append(self.name)
        return torch.zeros(self.shape)


def test_state_is_named_in_the_unwrapped_order_and_read_a_shard_at_a_time():
    reads = []
    # the optimizer's index 0 is a flat shard holding "b" then "a"; index 1 holds "c", which
    # has no state; the unwrapped model's order is a, b, c
    members = [({"lr": 0.1}, [("b", "flat0", 0), ("a", "flat0", 0), ("c", "c_shard", 1)])]

    def state_of(member):
        name, _, index = member
        if index == 1:
            return None
        return {"exp_avg": _Lazy(f"{name}.exp_avg", reads),
                "exp_avg_sq": _Lazy(f"{name}.exp_avg_sq", reads), "step": 3}
    named = named_state(members, ["a", "b", "c"], state_of)
    assert named.param_groups == [({"lr": 0.1}, ["a", "b", "c"])]
    assert list(named.state) == ["a", "b"] and named.shard == {"a": "flat0", "b": "flat0"}
    # one state name across the shard's parameters, then the next: one gather each, live
    assert [(p, n) for p, n, _ in named.in_read_order()] == [
        ("a", "exp_avg"), ("b", "exp_avg"), ("a", "exp_avg_sq"), ("b", "exp_avg_sq"),
        ("a", "step"), ("b", "step")]
    added = []
    indexed, names = named.as_indexed_state_dict(lambda t: added.append(t) or len(added))
    assert names == ["a", "b", "c"] and indexed["param_groups"] == [{"lr": 0.1,
                                                                      "params": [0, 1, 2]}]
    assert indexed["state"] == {0: {"exp_avg": 1, "exp_avg_sq": 3, "step": 3},
                                1: {"exp_avg": 2, "exp_avg_sq": 4, "step": 3}}
    assert reads == ["a.exp_avg", "b.exp_avg", "a.exp_avg_sq", "b.exp_avg_sq"]
    assert list(named.param_group_entries(GET_STATE_DICT)) == [
        ("optimizer.param_groups.0.lr", ("optimizer", "param_groups", 0, "lr"), 0.1),
        ("optimizer.param_groups.0.params", ("optimizer", "param_groups", 0, "params"),
         ["a", "b", "c"])]


def test_the_read_order_is_what_the_writers_read():
    reads = []
    tensors = {"w": _Lazy("w", reads), "b": _Lazy("b", reads, (3,))}
    named = named_state([({}, [("w", "s", 0)])], ["w"],
                        lambda m: {"momentum_buffer": _Lazy("w.m", reads)})
    state = UnwrappedState(tensors, [("tied", "w")], named, {})
    momentum = named.state["w"]["momentum_buffer"]
    assert state.read_order(aliases_again=False) == [tensors["w"], tensors["b"], momentum]
    assert state.read_order(aliases_again=True) == [tensors["w"], tensors["b"], tensors["w"],
                                                    momentum]
    assert state.specs() == [("w", torch.float32, (2,)), ("b", torch.float32, (3,)),
                             ("tied", torch.float32, (2,))]
    assert [n for n, _ in state.entries()] == ["w", "b"] and reads == ["w", "b"]


def test_a_shard_is_named_by_the_parameters_it_holds():
    assert holding(["layers.0.mlp.up.weight", "layers.0.mlp.up.bias", "layers.0.ln.weight"]) \
        == "the shard of layers.0.mlp.up.weight and 2 more"
    assert holding(["lm_head.weight"]) == "the shard of lm_head.weight"
