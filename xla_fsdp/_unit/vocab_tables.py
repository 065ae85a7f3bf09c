"""Which of a unit's parameters are vocabulary tables under ``vocab_parallel``, and the
forwards their modules run on the shards (see [Note: vocabulary-parallel tables]).

A table is an ``nn.Embedding``'s weight, or an ``nn.Linear``'s weight shaped like one of the
unit's embedding tables (an untied LM head; its bias, if any, stays an ordinary parameter,
added to the logits), held only by modules whose forward is torch's own; a weight held by
anything else as well (a module that reads it as a plain tensor, a subclass with a forward
of its own) stays an ordinary parameter. Code that reads a table's attribute directly
finds an empty placeholder (see [Note: a freed placeholder is empty]):
``F.linear(h, embed.weight)`` fails there, but a reduction over it is 0.
"""
from __future__ import annotations

import types
import warnings
from typing import Callable, List, Set

import torch
import torch.nn as nn

from .._sharding.collectives import Collectives
from .._sharding.vocab_parallel import lookup, project, table_rows
from .._xla.patched_linear import computes_as_torch
from .._xla.trace_only import to_device
from .param_record import Member
from .shard_group import ShardGroup


def _owner_kind(module: nn.Module, attr: str) -> str:
    """A table's module computes as torch's own class does: the vocabulary-parallel forward
    replaces its ``forward``, so a subclass's own (a scaled or offset lookup, extra
    arguments) would be lost. Such a module's weight stays an ordinary parameter."""
    if attr != "weight":
        return ""
    if computes_as_torch(module, nn.Embedding):
        return "embedding"
    if computes_as_torch(module, nn.Linear):
        return "projection"
    return ""


def table_ids(found: List[Member]) -> Set[int]:
    """The ids of the parameters in ``found`` that are vocabulary tables."""
    shapes = {tuple(p.shape) for p, owners, _ in found
              if any(_owner_kind(m, a) == "embedding" for m, a in owners)}
    tables = set()
    for p, owners, names in found:
        kinds = {_owner_kind(m, a) for m, a in owners}
        own = [type(m).__name__ for m, a in owners if a == "weight" and not _owner_kind(m, a)
               and (isinstance(m, nn.Embedding)
                    or isinstance(m, nn.Linear) and tuple(p.shape) in shapes)]
        if own:
            warnings.warn(f"vocab_parallel: '{names[0]}' is held by {own[0]}, whose forward "
                          f"is not torch's own, so it stays an ordinary parameter, gathered "
                          f"for the forward: a vocabulary-parallel lookup would replace that "
                          f"forward")
        if "" in kinds or tuple(p.shape) not in shapes or not p.numel():
            continue
        for m, _ in owners:
            if isinstance(m, nn.Embedding) and (m.max_norm is not None or m.sparse
                                                or m.scale_grad_by_freq):
                raise ValueError(
                    f"vocab_parallel: embedding '{names[0]}' uses max_norm, sparse or "
                    f"scale_grad_by_freq, which a vocabulary-parallel lookup does not "
                    f"support; wrap it without vocab_parallel")
        tables.add(id(p))
    return tables


def compute_on_shard(shard_group: ShardGroup, collectives: Collectives,
                     divisor: Callable[[], float]) -> None:
    """Makes the modules holding ``shard_group``'s table compute on its shard, over
    ``collectives``; its gradient is divided by ``divisor()``, the unit's gradient divide
    factors when the forward runs."""
    (record,) = shard_group.records
    vocab = shard_group.layout.shapes[0][0]
    # one element, not a 0-d tensor: torch_xla bakes a 0-d one into the program
    first = to_device(torch.tensor([collectives.rank * shard_group.layout.shard_shape[0]]),
                      shard_group.shard.device)

    def rows() -> torch.Tensor:
        return table_rows(shard_group.shard, shard_group.compute_dtype, divisor())

    def embedding(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        return lookup(collectives, rows(), first, ids, module.padding_idx)

    def projection(module: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        logits = project(collectives, rows(), hidden, vocab)
        # an ordinary parameter, gathered with the unit's others
        return logits if module.bias is None else logits + module.bias

    for module, _ in record.owners:
        forward = embedding if isinstance(module, nn.Embedding) else projection
        module.forward = types.MethodType(forward, module)
