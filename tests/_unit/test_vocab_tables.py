"""Which parameters are vocabulary tables: only those whose every holder computes as torch's
own ``nn.Embedding`` or ``nn.Linear`` does, since the vocabulary-parallel forward replaces
the holder's."""
import pytest
import torch.nn as nn

from xla_fsdp._unit.vocab_tables import table_ids
from xla_fsdp._xla.patched_linear import patch_linear_layers


class ScaledEmbedding(nn.Embedding):
    def forward(self, tokens):
        return super().forward(tokens) * 2.0


class ScaledHead(nn.Linear):
    def forward(self, hidden):
        return super().forward(hidden) * 0.5


class Plain(nn.Embedding):   # a subclass that keeps torch's forward
    pass


def _members(*modules):
    return [(m.weight, [(m, "weight")], [f"m{i}.weight"]) for i, m in enumerate(modules)]


def test_tables_are_held_by_modules_computing_as_torchs_own():
    emb, head, patched, plain = nn.Embedding(9, 4), nn.Linear(4, 9), nn.Linear(4, 9), Plain(9, 4)
    patch_linear_layers(patched)   # the wrapper's weight-reading forward keeps it a table
    found = _members(emb, head, patched, plain, nn.Linear(4, 4))
    assert table_ids(found) == {id(emb.weight), id(head.weight), id(patched.weight),
                                id(plain.weight)}


@pytest.mark.parametrize("kind", ["embedding", "head", "instance_forward"])
def test_a_forward_of_its_own_keeps_the_weight_ordinary_and_says_so(kind):
    emb, head = nn.Embedding(9, 4), nn.Linear(4, 9)
    if kind == "embedding":
        emb = ScaledEmbedding(9, 4)
    elif kind == "head":
        head = ScaledHead(4, 9)
    else:
        head.forward = lambda hidden: hidden
    name = {"embedding": "ScaledEmbedding", "head": "ScaledHead",
            "instance_forward": "Linear"}[kind]
    with pytest.warns(UserWarning, match=f"is held by {name}, whose forward is not torch's "
                                         f"own, so it stays an ordinary parameter"):
        tables = table_ids(_members(emb, head))
    # a head is a table only when shaped like a table an embedding holds
    assert tables == (set() if kind == "embedding" else {id(emb.weight)})


def test_a_tied_table_held_by_a_subclass_is_ordinary():
    emb, head = ScaledEmbedding(9, 4), nn.Linear(4, 9, bias=False)
    head.weight = emb.weight
    with pytest.warns(UserWarning, match="'m0.weight' is held by ScaledEmbedding"):
        tables = table_ids([(emb.weight, [(emb, "weight"), (head, "weight")], ["m0.weight"])])
    assert tables == set()
