"""Finds and validates the per-rank files of one sharded checkpoint."""
from __future__ import annotations

import contextlib
import fnmatch
import glob
import os
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from ..._sharding.names import SHARD_PREFIX
from ..files import CheckpointError, CheckpointFile
from ..formats.per_rank import RANK_TAIL, SHARD_METADATA, RankRecord, ShardMetadata
from ..formats.keys import MODEL


@dataclass
class ShardSet:
    files: List[CheckpointFile]          # index = rank
    metadata: ShardMetadata              # rank 0's
    pattern: str

    @property
    def world_size(self) -> int:
        return len(self.files)

    def close(self) -> None:
        for f in self.files:
            f.close()


class IncompleteCheckpoint(CheckpointError):
    """The files look like a checkpoint still being written: ranks missing, a file
    unreadable, or files from different saves. Waiting may cure it."""


def prefix_in_directory(prefix: str, suffix: str) -> str:
    """``prefix``, or, when it matches no file and is a directory holding one checkpoint's
    rank files (a ``CheckpointManager`` step directory holds ``checkpoint_rank-*``), the
    prefix of those files. A directory holding several, a DCP checkpoint or a manager's
    steps is refused with the prefix or directory to pass instead."""
    if glob.glob(glob.escape(prefix) + suffix) or not os.path.isdir(prefix):
        return prefix
    names = os.listdir(prefix)
    inside = sorted({os.path.join(prefix, RANK_TAIL.sub("", n)) for n in names
                     if RANK_TAIL.search(n) and fnmatch.fnmatchcase(n, "*" + suffix)})
    if len(inside) == 1:
        return inside[0]
    if inside:
        raise CheckpointError(f"{prefix} holds several per-rank checkpoints; pass one of the "
                              f"prefixes {inside} as --ckpt_prefix")
    if ".metadata" in names:
        raise CheckpointError(f"{prefix} is a DCP checkpoint, not per-rank files: load it with "
                              f"xla_fsdp.checkpoint.load_dcp or load_consolidated")
    steps = sorted(n for n in names if re.fullmatch(r"step\d{6,}", n))
    if steps:
        raise CheckpointError(f"{prefix} is a CheckpointManager's directory: pass one of its "
                              f"step directories as --ckpt_prefix, e.g. "
                              f"{os.path.join(prefix, steps[-1])}")
    raise CheckpointError(f"{prefix} is a directory holding no per-rank checkpoint files "
                          f"(*{suffix})")


def find_shard_set(prefix: str, suffix: str, outputs: Sequence[str] = (),
                   verify: bool = True, skip_outputs: bool = False) -> ShardSet:
    """Opens ``prefix + suffix`` (a glob) and checks the files form one complete checkpoint.

    Refuses, naming the files at fault: no match, a match that is one of ``outputs`` (with
    ``skip_outputs``, such a match is left out instead), files that are not sharded
    checkpoints, duplicate or missing ranks, mixed world sizes, mixed wrappings or saves,
    and (with ``verify``) any record failing its CRC-32. ``IncompleteCheckpoint`` is
    raised for what a save still under way would explain."""
    pattern = prefix + suffix
    outs = {os.path.abspath(o) for o in outputs}
    # the prefix is a path, taken as written ('run[1]/ck' names that directory); the suffix
    # is the pattern that completes it to every rank's file
    paths = sorted(p for p in glob.glob(glob.escape(prefix) + suffix)
                   if not (skip_outputs and os.path.abspath(p) in outs))
    if not paths:
        raise CheckpointError(f"no files match {pattern!r}")
    inputs = {os.path.abspath(p) for p in paths}
    for out in sorted(outs):
        if out in inputs:
            raise CheckpointError(f"the output {out} would overwrite an input; choose another "
                                  f"--save_path")
        if not skip_outputs and fnmatch.fnmatchcase(out, os.path.abspath(pattern)):
            raise CheckpointError(
                f"the output {out} matches the input pattern {pattern!r}, so the next run would "
                f"read it as a rank file; choose another --save_path or a narrower --ckpt_suffix")
    with contextlib.ExitStack() as to_close:
        try:
            files = [to_close.enter_context(CheckpointFile(path)) for path in paths]
        except CheckpointError as exc:
            raise IncompleteCheckpoint(str(exc)) from None
        by_rank = check_shard_set(files, pattern)
        if verify:
            try:
                for f in by_rank:
                    f.verify()
            except CheckpointError as exc:
                raise IncompleteCheckpoint(str(exc)) from None
        to_close.pop_all()
    return ShardSet(by_rank, ShardMetadata(by_rank[0].tree[SHARD_METADATA]), pattern)


# seconds a consolidation waits for rank files before it says so
_SAY_WAITING_AFTER = 10.0


def wait_for_shard_set(prefix: str, suffix: str, outputs: Sequence[str], timeout: float
                       ) -> ShardSet:
    """``find_shard_set`` (with ``skip_outputs``), retried every 0.2 s while the set looks
    incomplete, for up to ``timeout`` seconds: for consolidation called from training code
    while other ranks may still be writing (``xm.save`` does not wait for the other ranks
    since torch_xla 2.9)."""
    start = time.monotonic()
    told = False
    while True:
        try:
            return find_shard_set(prefix, suffix, outputs, skip_outputs=True)
        except IncompleteCheckpoint as exc:
            waited = time.monotonic() - start
            if waited >= timeout:
                raise IncompleteCheckpoint(
                    f"waited {timeout:g} s for the checkpoint to be complete, but: {exc}"
                ) from None
            if waited >= _SAY_WAITING_AFTER and not told:   # offline, it may never be
                told = True
                warnings.warn(f"still waiting, up to {timeout:g} s in all, for the checkpoint "
                              f"to be complete (ranks still writing?): {exc}", stacklevel=3)
        time.sleep(0.2)


def check_shard_set(files: List[CheckpointFile], pattern: str) -> List[CheckpointFile]:
    for f in files:
        tree = f.tree
        if not isinstance(tree, dict) or SHARD_METADATA not in tree or MODEL not in tree:
            raise CheckpointError(f"{f.path} is not a per-rank FSDP checkpoint: "
                                  + _what_else(tree, pattern))
    worlds = {f.path: ShardMetadata(f.tree[SHARD_METADATA]).world_size for f in files}
    if len(set(worlds.values())) > 1:
        raise CheckpointError(f"{pattern!r} mixes checkpoints of different world sizes: "
                              + ", ".join(f"{p} (world size {w})" for p, w in worlds.items()))
    world = next(iter(worlds.values()))
    files = _first_replica(files)
    by_rank: Dict[int, CheckpointFile] = {}
    for f in files:
        rank = ShardMetadata(f.tree[SHARD_METADATA]).rank
        if rank in by_rank:
            raise CheckpointError(f"{by_rank[rank].path} and {f.path} both hold rank {rank}"
                                  + _independent_groups(by_rank[rank], f))
        by_rank[rank] = f
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        raise IncompleteCheckpoint(f"{pattern!r} matches {len(files)} files of a world of "
                                   f"{world}; the files of ranks {missing} are missing")
    ordered = [by_rank[r] for r in range(world)]
    _check_same(ordered, "wrapping", _wrapping_identity)
    _check_same(ordered, "save", save_identity, IncompleteCheckpoint)
    return ordered


def _first_replica(files: List[CheckpointFile]) -> List[CheckpointFile]:
    """[Note: files of several sharding groups]
    Under ``sharding_groups`` each group numbers its ranks from 0, so where every rank
    writes a file (torch_xla's recipe, which Lightning's full save and Hugging Face
    Trainer's ``save_model`` follow) one pattern matches a file of each group for every
    rank. Replicas (``replicate_across_groups``) hold the same shards: the files of the
    lowest group among them are the checkpoint. Independent groups hold different parts of
    one model, which no one group's files make whole: refused, saying so. The writer's group
    is in its shard metadata; files without it are one group's."""
    writers = [ShardMetadata(f.tree[SHARD_METADATA]).sharding_group for f in files]
    replicas = [w[0] for w in writers if w is not None and w[1]]
    if not replicas or len(replicas) != len(files):
        return files
    first = min(replicas)
    return [f for f, w in zip(files, writers, strict=True) if w is not None and w[0] == first]


def _independent_groups(a: CheckpointFile, b: CheckpointFile) -> str:
    first, second = (ShardMetadata(f.tree[SHARD_METADATA]).sharding_group for f in (a, b))
    if first is None or second is None or first[0] == second[0]:
        return ""
    return (f": they are files of sharding groups {first[0]} and {second[0]}, each "
            f"holding a different part of the model (sharding_groups without "
            f"replicate_across_groups), which one group's files cannot make whole. Save "
            f"with xla_fsdp.checkpoint.save_sharded or save_consolidated, which write every "
            f"group's part")


def _what_else(tree: Any, pattern: str) -> str:
    """What a file that is not a per-rank checkpoint holds, and what to do about it."""
    if not isinstance(tree, dict):
        return f"it holds a {type(tree).__name__}, not a dict with 'model' and 'shard_metadata'"
    keys = sorted(map(str, tree))
    shown = ", ".join(repr(k) for k in keys[:3]) + (f", ... ({len(keys)} keys)"
                                                     if len(keys) > 3 else "") or "no keys"
    if any(SHARD_PREFIX in k for k in keys):
        # the wrapped model's state_dict() alone: each rank's shards, without the metadata
        # that says how they were cut
        return (f"it holds a wrapped model's shards ({shown}) without the shard metadata "
                f"that says how they were cut, so they can be neither merged nor loaded at "
                f"another world size. Save with xla_fsdp.checkpoint.save_sharded(prefix, "
                f"model, optimizer), or as torch_xla's recipe does: {{'model': "
                f"model.state_dict(), 'shard_metadata': model.get_shard_metadata(), "
                f"'optimizer': optimizer.state_dict()}}")
    return (f"it has {shown}, not 'model' and 'shard_metadata'; if it is a consolidated "
            f"checkpoint, load it with load_consolidated, or narrow the pattern (the "
            f"consolidation tool's --ckpt_suffix) so that {pattern!r} matches only the "
            f"per-rank files")


def save_identity(f: CheckpointFile) -> tuple:
    """Equal for the files of one save: save_sharded's save counter and the id rank 0 drew
    for the save, and the optimizer steps the model had taken (``update_count`` in
    xla_fsdp's shard metadata, also in files written with torch_xla's recipe); None where
    the writer recorded none of them."""
    record = RankRecord.of(f.tree)
    return (record.save_index if record else None, record.save_id if record else None,
            ShardMetadata(f.tree[SHARD_METADATA]).update_count)


def _wrapping_identity(f: CheckpointFile) -> Optional[str]:
    record = RankRecord.of(f.tree)
    if record is not None:
        return record.fingerprint
    return ShardMetadata(f.tree[SHARD_METADATA]).fingerprint()


def _check_same(files: List[CheckpointFile], what: str, key: Any,
                error: type = CheckpointError) -> None:
    first = key(files[0])
    for f in files[1:]:
        if key(f) != first:
            raise error(f"{files[0].path} and {f.path} come from different {what}s "
                        f"({first} vs {key(f)}); a checkpoint's files must all be written by "
                        f"the same save of the same model")
