"""Modules compiled with ``torch.compile`` before they are wrapped.

``torch.compile(module)`` returns an ``OptimizedModule`` that holds the module as
``_orig_mod`` and runs its ``__call__`` under Dynamo. A unit built around it shards the
inner module (so names and checkpoints are those of the uncompiled model) and calls the
compiled module, whose Dynamo frame then meets the unit's hooks on the inner module.

[Note: FSDP's hooks under torch.compile]
A compiled model runs its units one of two ways. Where it can, the gathers are traced into
the compiled graph with the compute (see [Note: collectives traced into the compiled graph]
in ``_unit.traced_unshard``): one forward and one backward program for the whole model. Where
it cannot (a unit built around a ``torch.compile``'d module, whose hooks run outside its
region; ``no_sync``; ``offload_optimizer``; sharding groups), the graph breaks at each
unit: the unit's hooks run eagerly between compiled regions, exactly the code the eager
path runs, and a region sees the full parameters as graph inputs (Dynamo lifts a module's
parameters as inputs, so swapping their ``.data`` needs no recompile). Freeing, regathering
in backward and the per-parameter reduction hooks keep their eager meaning there, and so
do checkpoints. One cost remains on that path: AOTAutograd's partitioner saves what a
region's linear layers derive from their weights in forward (the transposes) as buffers
of their own, so a unit's weights still live from forward to backward in that form
(benchmarks/results/compiled.md measures it).

On the graph-break path what changes under compile is when work executes. torch_xla's
openxla bridge runs each compiled region as its own computation, materialising the
region's inputs first, and syncs the device when it compiles a region. So the traced overlap the eager path builds
with optimization barriers and prefetches cannot exist across a region boundary; instead:
* a unit's gather executes in its pre-forward (and pre-backward) hook, before the region
  that reads it; prefetching is off, since a prefetched gather would only execute later
  with the next region's inputs;
* a unit's reductions are held until its last shard group's gradients arrive, then issued
  and executed together; at every unit's pre-backward hook the reductions held by any unit
  (one whose parameters span several regions, as a model's root does) execute too. So each
  region's full gradients are freed as the backward moves on, not all held to the step's
  sync (a pending reduce-scatter keeps its inputs alive), and no reduction is pending when
  Dynamo compiles the next region's backward;
* the barriers on the unit's inputs and outputs are left out: they order work inside one
  traced graph, and an in-place barrier on a region's output would replace a tensor the
  bridge still holds, whose buffer XLA then donates.
These executions also mean a sync inside a compile never holds a collective, which is what
lets one process hosting several virtual devices compile a region once for all of them.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch.nn as nn

from .._xla.private_api import compiled_inner


def split_compiled(module: nn.Module) -> Tuple[nn.Module, Optional[nn.Module]]:
    """The module to shard, and the compiled module to call instead of it (or None)."""
    inner = compiled_inner(module)
    return (module, None) if inner is None else (inner, module)
