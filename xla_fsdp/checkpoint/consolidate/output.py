"""Writing a consolidated checkpoint: the unwrapped model's state dict (and optimizer state)
read one tensor at a time from the shards, streamed to a ``.pth`` or ``.safetensors`` file, and
verified by ``formats.verify_written``."""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch

from ..files import SafetensorsWriter, StagedFile, TorchFileWriter, atomic_path
from ..files.reader import materialized
from ..metadata import MODEL
from .optimizer import consolidate_optimizer
from .plan import ModelPlan, SpreadTensor
from .shard_set import ShardSet


def ordered_params(plan: ModelPlan) -> List[tuple]:
    """(name, shard group spec, param) of every parameter in the unwrapped model's order."""
    by_name = {p.name: (g, p) for g in plan.shard_groups for p in g.params}
    known = set(plan.param_order)
    order = plan.param_order + [n for n in by_name if n not in known]
    return [(n, *by_name[n]) for n in order]


def model_entries(plan: ModelPlan, shards: ShardSet) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of the consolidated model state dict, read one at a time."""
    files = shards.files
    for name, spec, param in ordered_params(plan):
        yield name, SpreadTensor([f.tree[MODEL][spec.key] for f in files], spec, param).read()
    for key, name in plan.buffers.items():
        tensor = files[0].tree[MODEL][key].read()
        if key in plan.buffer_dtypes:
            tensor = tensor.to(plan.buffer_dtypes[key])
        yield name, tensor


def entry_specs(plan: ModelPlan, shards: ShardSet) -> List[tuple]:
    """(name, dtype, shape) of every entry ``_model_entries`` yields, then the aliases."""
    model = shards.files[0].tree[MODEL]
    specs = [(n, model[g.key].dtype, p.shape) for n, g, p in ordered_params(plan)]
    specs += [(n, plan.buffer_dtypes.get(k, model[k].dtype), model[k].shape)
              for k, n in plan.buffers.items()]
    source = {n: (d, s) for n, d, s in specs}
    specs += [(alias, *source[src]) for alias, src in plan.aliases]
    return specs


def write_consolidated(shards: ShardSet, plan: ModelPlan, path: str, fmt: str,
                       with_optimizer: bool, progress: Callable[[int], None]) -> List[str]:
    """Writes the consolidated checkpoint; returns the paths written."""
    if fmt == "safetensors":
        specs = entry_specs(plan, shards)
        sources = dict(plan.aliases)
        written = [path] + ([os.path.splitext(path)[0] + ".optimizer.pth"]
                            if with_optimizer else [])
        # the pair is replaced together: neither file goes in before the other is on disk
        staged = [StagedFile(p) for p in written]
        try:
            with staged[0].writing() as tmp:
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
                with staged[1].writing() as tmp:
                    writer = TorchFileWriter(tmp)
                    optimizer, names = consolidate_optimizer(shards, plan, writer.add)
                    writer.finish(dict({"optimizer": optimizer, "optimizer_param_names": names},
                                       **_extra(shards)))
        except BaseException:
            for file in staged:
                file.discard()
            raise
        for file in staged:
            file.put_in_place()
        return written
    with atomic_path(path) as tmp:
        writer = TorchFileWriter(tmp)
        model: Dict[str, Any] = {}
        for name, tensor in model_entries(plan, shards):
            model[name] = writer.add(tensor)
            progress(tensor.numel())
        for alias, source in plan.aliases:
            model[alias] = model[source]  # one record under both names: stays tied on load
        tree: Dict[str, Any] = {"model": model}
        if with_optimizer:
            tree["optimizer"], tree["optimizer_param_names"] = consolidate_optimizer(
                shards, plan, writer.add)
        tree.update(_extra(shards))
        writer.finish(tree)
    return [path]


def _extra(shards: ShardSet) -> Dict[str, Any]:
    """What the training code saved as ``extra`` (a step count, a scheduler), kept with the
    optimizer for a resume."""
    tree = shards.files[0].tree
    return {"extra": materialized(tree["extra"])} if "extra" in tree else {}
