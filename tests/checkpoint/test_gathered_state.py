"""What every rank of a consolidated save gathers (``gathered_state.Gathers``), decided
before the first gather (no XLA: the ranks' listings are given)."""
from types import SimpleNamespace

import pytest
import torch

from xla_fsdp._sharding.layout import FlatLayout
from xla_fsdp.checkpoint import gathered_state
from xla_fsdp.checkpoint.files import CheckpointError
from xla_fsdp.checkpoint.gathered_state import Gathers, _Cut

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
