"""Writing a consolidated checkpoint: the unwrapped model's state dict (and optimizer state)
read one tensor at a time from the shards, streamed to a ``.pth`` or ``.safetensors`` file, and
verified by ``formats.verify_written``."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch

from ..consolidated_format import OPTIMIZER_NAMES, optimizer_companion
from ..files import SafetensorsWriter, TorchFileWriter, atomic_path, atomic_paths
from ..files.reader import materialized
from ..metadata import EXTRA, MODEL, OPTIMIZER
from ..per_rank.optimizer import consolidate_optimizer
from ..per_rank.plan import ModelPlan, unwrapped_tensors
from ..per_rank.shard_set import ShardSet


def model_entries(plan: ModelPlan, shards: ShardSet) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of the consolidated model state dict, read one at a time."""
    for name, tensor in unwrapped_tensors(plan, shards.files).items():
        yield name, tensor.read()


def entry_specs(plan: ModelPlan, shards: ShardSet) -> List[tuple]:
    """(name, dtype, shape) of every entry ``model_entries`` yields, then the aliases."""
    specs = [(n, t.dtype, tuple(t.shape))
             for n, t in unwrapped_tensors(plan, shards.files).items()]
    source = {n: (d, s) for n, d, s in specs}
    specs += [(alias, *source[src]) for alias, src in plan.aliases]
    return specs


def write_consolidated(shards: ShardSet, plan: ModelPlan, path: str, fmt: str,
                       with_optimizer: bool, progress: Callable[[int], None]) -> List[str]:
    """Writes the consolidated checkpoint; returns the paths written."""
    if fmt == "safetensors":
        specs = entry_specs(plan, shards)
        sources = dict(plan.aliases)
        written = [path] + ([optimizer_companion(path)]
                            if with_optimizer else [])
        # the pair is replaced together: neither file goes in before the other is on disk
        with atomic_paths(written) as staged:
            with staged[path].writing() as tmp:
                writer = SafetensorsWriter(tmp, specs, {"format": "pt"})
                held: Dict[str, torch.Tensor] = {}
                for name, tensor in model_entries(plan, shards):
                    writer.add(name, tensor)
                    progress(tensor.numel())
                    if name in sources.values():
                        held[name] = tensor  # a tied weight is written again under its alias
                for alias, source in plan.aliases:
                    writer.add(alias, held[source])
                writer.finish()
            if with_optimizer:
                with staged[written[1]].writing() as tmp:
                    writer = TorchFileWriter(tmp)
                    optimizer, names = consolidate_optimizer(shards, plan, writer.add)
                    writer.finish(dict({OPTIMIZER: optimizer, OPTIMIZER_NAMES: names},
                                       **_extra(shards)))
            else:  # an earlier save's optimizer file would be loaded with these weights
                with contextlib.suppress(FileNotFoundError):
                    os.remove(optimizer_companion(path))
        return written
    with atomic_path(path) as tmp:
        writer = TorchFileWriter(tmp)
        model: Dict[str, Any] = {}
        for name, tensor in model_entries(plan, shards):
            model[name] = writer.add(tensor)
            progress(tensor.numel())
        for alias, source in plan.aliases:
            model[alias] = model[source]  # one record under both names: stays tied on load
        tree: Dict[str, Any] = {MODEL: model}
        if with_optimizer:
            tree[OPTIMIZER], tree[OPTIMIZER_NAMES] = consolidate_optimizer(
                shards, plan, writer.add)
        tree.update(_extra(shards))
        writer.finish(tree)
    return [path]


def _extra(shards: ShardSet) -> Dict[str, Any]:
    """What the training code saved as ``extra`` (a step count, a scheduler), kept with the
    optimizer for a resume."""
    tree = shards.files[0].tree
    return {EXTRA: materialized(tree[EXTRA])} if EXTRA in tree else {}
