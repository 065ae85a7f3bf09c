"""What every rank of a consolidated save gathers (``gathered_state.Gathers``), decided
before the first gather, and how often, and the optimizer param groups it saves (no XLA: the
ranks' listings and the gathered tensors are given)."""
from types import SimpleNamespace

import pytest
import torch

from xla_fsdp._sharding.layout import FlatLayout
from xla_fsdp.checkpoint import coordination, gathered_state
from xla_fsdp.checkpoint.files import CheckpointError
from xla_fsdp.checkpoint.gathered_state import Gathers, _Cut, read_every_entry
from xla_fsdp.checkpoint.unwrapped_state import UnwrappedState

TWO = SimpleNamespace(world_size=2)


def _gathers(sharding_group, monkeypatch, others):
    """A rank of ``sharding_group`` whose save lists one 4-element shard, the other ranks listing
    ``others``: (group, digest of what they list), or None for the same as this rank."""
    gathers = Gathers({"w": (torch.zeros(2), TWO)}, sharding_group)
    cut = _Cut(gathers, "w", FlatLayout([torch.Size([4])], 2, 1), 0, torch.float32)

    def exchange(tag, mine):
        return [mine] + [mine if o is None else o for o in others]
    monkeypatch.setattr(gathered_state, "exchange", exchange)
    return gathers, [cut]


def test_ranks_that_list_the_same_gathers_go_on(monkeypatch):
    gathers, reads = _gathers(0, monkeypatch, [None, None])
    gathers.follow(reads, keep=False)


def test_independent_groups_may_gather_their_own_parts(monkeypatch):
    # parts of a model-parallel model: each group's ranks agree among themselves
    gathers, reads = _gathers(0, monkeypatch, [None, (1, "other"), (1, "other")])
    gathers.follow(reads, keep=False)


@pytest.mark.parametrize("group", [0, 1])
def test_a_rank_that_lists_other_gathers_than_its_group_fails_every_rank(monkeypatch, group):
    # the disagreement is in group 1: its ranks and group 0's raise alike
    others = [None, (1, "a"), (1, "b")] if group == 0 else [(0, "x"), (0, "x"), (1, "b")]
    gathers, reads = _gathers(group, monkeypatch, others)
    with pytest.raises(CheckpointError, match="ranks of a sharding group would gather "
                                              "different tensors"):
        gathers.follow(reads, keep=False)


def test_entries_cut_from_one_tensor_are_read_from_one_gather(monkeypatch):
    # a scanned stack's order: layer 0's a and b, then layer 1's; a and b are each one
    # stacked shard, so the model's order alternates between the two gathers
    gathered = []

    def gathered_on_host(run, keep):
        gathered.append(len(run))
        return [torch.arange(4.0) + 10 * len(gathered) for _ in run] if keep else []
    monkeypatch.setattr(gathered_state, "gathered_on_host", gathered_on_host)
    monkeypatch.setattr(gathered_state, "exchange", lambda tag, mine: [mine, mine])
    monkeypatch.setattr(coordination, "GATHERED_PER_SYNC_BYTES", 1)  # a run per tensor
    gathers = Gathers({"a": (torch.zeros(2), TWO), "b": (torch.zeros(2), TWO)}, None)
    layout = FlatLayout([torch.Size([2]), torch.Size([2])], 2, 1)
    cuts = {f"layers.{i}.{x}": _Cut(gathers, x, layout, i, torch.float32)
            for i in range(2) for x in "ab"}
    state = UnwrappedState(cuts, [], None, {})
    got = read_every_entry(state, gathers, keep=True)
    assert gathered == [1, 1]   # one gather of a, one of b: not one per entry
    assert list(got) == list(cuts)   # in the model's order
    assert [v.tolist() for v in got.values()] == [[10, 11], [20, 21], [12, 13], [22, 23]]


def test_the_optimizer_param_groups_are_saved_as_its_state_dict_gives_them(monkeypatch):
    # as the per-rank files hold them (``optimizer.state_dict()``), so that a live save equals
    # the files' consolidation: a state dict hook's change included, which the live
    # ``param_groups`` lack
    shard = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([shard], lr=0.1)
    optimizer.register_state_dict_post_hook(
        lambda opt, saved: saved["param_groups"][0].update(lr=0.5))
    monkeypatch.setattr(gathered_state, "optimizer_shard_keys", lambda model, opt: ["w"])
    slots = {"w": (FlatLayout([torch.Size([4])], 2, 1), ["w"], TWO)}
    named = gathered_state._named_optimizer_state(None, optimizer, Gathers({}, None), {}, slots,
                                                  ["w"])
    assert [(group["lr"], names) for group, names in named.param_groups] == [(0.5, ["w"])]
    assert optimizer.param_groups[0]["lr"] == 0.1
