"""Hugging Face Trainer's per-rank files as the loader's source, at any world size.

Under XLA FSDP, Trainer writes each rank's state in two files of its checkpoint directory:
``rank{r}-of-{N}-pytorch_model.bin`` (torch_xla's ``model`` and ``shard_metadata``) and
``rank{r}-of-{N}-optimizer.pt`` (``optimizer`` and the same ``shard_metadata``). A rank's two
files together are one torch_xla recipe file, which ``sources.per_rank_files`` reads as it
reads any per-rank checkpoint: each new rank reads the runs its own shards hold.

Trainer's optimizer has two param groups (decayed and not), so the files do not say which
shard an optimizer index is; ``param_names`` (the shards' names, group by group, as the
resuming optimizer holds them) says it, which holds when the resumed run wraps the model and
builds its optimizer as the saved run did. The shapes are checked against every file.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Iterable, List, Sequence, Set, Tuple

from ..files import CheckpointError, CheckpointFile
from ..per_rank.plan import plan_model
from ..per_rank.shard_set import find_shard_set
from ..formats.per_rank import SHARD_METADATA
from ..formats.keys import OPTIMIZER
from .entries import EntrySource
from .per_rank_files import shard_set_source


def trainer_file(directory: str, rank: int, world: int, name: str) -> str:
    """Trainer's path for rank ``rank``'s file ``name`` of a save from ``world`` ranks."""
    return os.path.join(directory, f"rank{rank}-of-{world}-{name}")


def trainer_file_worlds(listed: Iterable[str], name: str) -> Set[int]:
    """The world sizes of the saves whose rank files ``name`` are among ``listed``."""
    pattern = re.compile(r"rank\d+-of-(\d+)-" + re.escape(name) + "$")
    return {int(m.group(1)) for m in map(pattern.match, listed) if m}


def open_trainer_files(directory: str, world: int, weights_name: str, optimizer_name: str,
                       param_names: Sequence[Sequence[str]], share: Tuple[int, int]
                       ) -> EntrySource:
    """The state Trainer saved in ``directory`` from ``world`` ranks, as a source holding the
    model and the optimizer. ``param_names``: per param group, the name of each shard the
    group holds. ``share`` (i, n): this caller checks the CRC-32s of every n-th file from
    the i-th."""
    shards = find_shard_set(os.path.join(directory, "rank"), f"*-of-{world}-{weights_name}",
                            verify=False)
    opened: List[CheckpointFile] = []
    with contextlib.ExitStack() as to_close:
        to_close.callback(shards.close)
        for rank, f in enumerate(shards.files):
            path = trainer_file(directory, rank, world, optimizer_name)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path} is missing: {f.path} has no optimizer state "
                                      f"beside it")
            opened.append(to_close.enter_context(CheckpointFile(path)))
            saved = opened[-1].tree
            if not isinstance(saved, dict) or OPTIMIZER not in saved \
                    or saved.get(SHARD_METADATA) != f.tree[SHARD_METADATA]:
                raise CheckpointError(f"{path} is not the optimizer state of the save that "
                                      f"wrote {f.path} (its shard metadata differs)")
            param_groups = saved[OPTIMIZER].get("param_groups", [])
            if [len(g["params"]) for g in param_groups] != [len(n) for n in param_names]:
                raise CheckpointError(
                    f"{path} holds param groups of {[len(g['params']) for g in param_groups]} "
                    f"parameters, and this run's optimizer "
                    f"{[len(n) for n in param_names]}: the model or the optimizer is built "
                    f"otherwise than in the run that saved it")
            for param_group, names in zip(param_groups, param_names):
                param_group["param_names"] = list(names)
            f.tree[OPTIMIZER] = saved[OPTIMIZER]
        for f in shards.files[share[0]::share[1]] + opened[share[0]::share[1]]:
            f.verify()
        plan = plan_model(shards)
        return shard_set_source(shards, plan, True, [to_close.pop_all().close])
