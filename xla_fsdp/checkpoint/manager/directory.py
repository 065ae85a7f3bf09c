"""A directory of checkpoints named by their steps: which are complete, which is latest,
which to remove. Only the filesystem; no model, no collective.

[Note: complete means marked]
A checkpoint is the directory ``step{step:06d}`` (wider past a million steps) holding one
save's files, per-rank or DCP, and it exists only once it holds the marker ``COMPLETE``.
The marker is written, atomically, after the save was published on every rank (every file
in place). Everything else follows from that one rule:
- ``latest()`` is the newest marked step, so a save killed midway leaves the previous
  checkpoint latest, whatever files the killed one left;
- a directory without the marker is a leftover: ``remove_leftovers()``, run when a manager
  starts, removes it with any temporary file beside it;
- retention removes the marker first, then the files, so a removal interrupted midway
  leaves a leftover, never a checkpoint with files missing; and it removes only checkpoints
  older than a marked one, so the newest complete checkpoint is never removed.
The file ``latest`` names the newest checkpoint for people and scripts (the example's
``--resume`` read it before); nothing here reads it.

Every rank may call these: each writes through a temporary file of its own and tolerates
files another rank removed first, so ranks on a shared filesystem and ranks on hosts of
their own both end with the same directory.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
from typing import List, Optional

from ..files import atomic_path, remove_if_there

MARKER = "COMPLETE"
LATEST = "latest"
_STEP = re.compile(r"^step(\d{6,})$")


def step_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"a checkpoint's step must be >= 0, not {step}")
    return f"step{step:06d}"


class CheckpointDirectory:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def path(self, step: int) -> str:
        return os.path.join(self.root, step_name(step))

    def _steps(self) -> List[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_STEP.match, names) if m)

    def complete_steps(self) -> List[int]:
        """The steps of the complete checkpoints, oldest first."""
        return [s for s in self._steps() if self.is_complete(s)]

    def is_complete(self, step: int) -> bool:
        return os.path.exists(os.path.join(self.path(step), MARKER))

    def latest(self) -> Optional[int]:
        return max(self.complete_steps(), default=None)

    def prepare(self, step: int) -> str:
        """An empty directory for a new save of ``step`` (what an earlier, unfinished save
        of it left is removed); returns it."""
        path = self.path(step)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
        return path

    def mark_complete(self, step: int) -> None:
        """Marks the save of ``step``, every file of which is in place, complete; names it
        in ``latest`` if it is the newest."""
        with atomic_path(os.path.join(self.path(step), MARKER)) as tmp, open(tmp, "w") as f:
            f.write(f"{step}\n")
        if self.latest() == step:
            with atomic_path(os.path.join(self.root, LATEST)) as tmp, open(tmp, "w") as f:
                f.write(step_name(step) + "\n")

    def keep_last(self, count: int) -> List[int]:
        """Removes complete checkpoints older than the newest ``count``; returns their
        steps."""
        steps = self.complete_steps()
        old = steps[:-count] if count > 0 else []
        for step in old:
            self.remove(step)
        return old

    def remove(self, step: int) -> None:
        remove_if_there(os.path.join(self.path(step), MARKER))
        shutil.rmtree(self.path(step), ignore_errors=True)

    def remove_leftovers(self) -> List[str]:
        """Removes what unfinished saves left: step directories without the marker, and
        temporary files in the directory itself. Returns their names."""
        removed = []
        for step in self._steps():
            if not self.is_complete(step):
                shutil.rmtree(self.path(step), ignore_errors=True)
                removed.append(step_name(step))
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.root):
                if name.startswith(".") and ".tmp-" in name:
                    remove_if_there(os.path.join(self.root, name))
                    removed.append(name)
        return removed
