"""Files that appear whole or not at all: a crash mid-write leaves the previous file intact,
and a write that fails for lack of space says which file, what it needed and what was free.

``atomic_path`` writes one file in one step. ``StagedFile`` is the same in two steps, for
writers that must hear from the other ranks before any of them replaces its file
(``save_sharded``, ``save_dcp``): write and flush the temporary file, then put it in place
or discard it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

from ..._xla.trace_only import refuse_writes
from .reader import CheckpointError

_NO_SPACE = {errno.ENOSPC: "no space left on the device",
             errno.EDQUOT: "the disk quota is exceeded"}

# temporary file -> the file it becomes, so that an error names the file the user asked for
_FINAL_NAMES: Dict[str, str] = {}


def _space_cause(exc: BaseException) -> Optional[Tuple[str, BaseException]]:
    """Why ``exc`` says a write found no space, and the exception in its chain that says so;
    None if it says something else. torch's zip writer reports a short write as
    ``RuntimeError: ... unexpected pos A vs B`` (or "file write failed"), with the
    ``OSError`` as its context when Python did the writing."""
    seen = set()
    link: Optional[BaseException] = exc
    short_write = None
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError) and link.errno in _NO_SPACE:
            return _NO_SPACE[link.errno], link
        text = str(link)
        if short_write is None and isinstance(link, RuntimeError) and (
                "unexpected pos" in text or "file write failed" in text):
            short_write = "a write came up short, as it does on a full disk", link
        link = link.__cause__ or link.__context__
    return short_write


def free_bytes(path: str) -> Optional[int]:
    """The space an unprivileged writer may still use on the filesystem holding ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    while directory and not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def is_out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that found no space (not one already reported as such)."""
    return not isinstance(exc, CheckpointError) and _space_cause(exc) is not None


def no_space_error(path: str, exc: BaseException, needed: Optional[int] = None,
                   writing: Optional[int] = None, written: Optional[int] = None
                   ) -> CheckpointError:
    """The error to raise, chained to ``exc`` (``is_out_of_space``), when writing ``path``
    failed for lack of space. ``needed``: at least what the whole file takes; ``writing``:
    the write that failed; ``written``: what was on disk then. Call it after removing the
    partial file, if you can, so that the free space reported is what a retry would have.

    Raise it directly (``raise no_space_error(...) from exc``): kept in a local of the
    frame it is raised from, it would hold that frame, and every file open there, in a
    reference cycle until the garbage collector runs."""
    cause, reported = _space_cause(exc) or ("the write failed", exc)
    facts = []
    if needed is not None:
        facts.append(f"the file needs at least {needed:,} bytes")
    if written is not None:
        facts.append(f"{written:,} bytes of it were written"
                     + (f" when a write of {writing:,} failed" if writing is not None else ""))
    elif writing is not None:
        facts.append(f"a write of {writing:,} bytes failed")
    free = free_bytes(path)
    if free is not None:
        facts.append(f"the filesystem has {free:,} bytes free")
    return CheckpointError(f"{_FINAL_NAMES.get(path, path)}: not written: {cause}; "
                           f"{', '.join(facts)} ({type(reported).__name__}: {reported})")


def file_size(path: str) -> Optional[int]:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def remove_if_there(*paths: str) -> None:
    """Removes each of ``paths`` that is there."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def guarded(path: str, abort: Callable[[], None], writing: Optional[int] = None,
            needed: Optional[int] = None) -> Iterator[None]:
    """A failed write of ``path`` in the body aborts it (``abort``) and, for lack of space,
    raises a ``CheckpointError`` naming the file ``path`` becomes."""
    try:
        yield
    except BaseException as exc:
        written = file_size(path)
        final = _FINAL_NAMES.get(path, path)  # before ``abort``, which may forget it
        abort()
        if not is_out_of_space(exc):
            raise
        raise no_space_error(final, exc, needed, writing, written) from exc


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StagedFile:
    """``path``, written first under a hidden temporary name beside it (so that a glob for
    the final names never matches a half-written file)."""

    def __init__(self, path: str, needed: Optional[int] = None) -> None:
        refuse_writes(path)
        self.path = os.path.abspath(path)
        directory, name = os.path.split(self.path)
        os.makedirs(directory, exist_ok=True)
        self.tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        self.needed = needed
        self.placed = False
        _FINAL_NAMES[self.tmp] = self.path

    @contextlib.contextmanager
    def writing(self) -> Iterator[str]:
        """Yields the temporary path for the body to write, then flushes the file to disk.
        On error the file is removed, and a lack of space raises a ``CheckpointError``
        naming ``path``."""
        with guarded(self.tmp, self.discard, needed=self.needed):
            yield self.tmp
            _fsync(self.tmp)  # a filesystem may report the lack of space only here

    def put_in_place(self) -> None:
        """Renames the written file over ``path``."""
        try:
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        self.placed = True
        _FINAL_NAMES.pop(self.tmp, None)
        _fsync(os.path.dirname(self.path))  # the rename itself must survive a power loss

    def discard(self) -> None:
        """Removes the temporary file, if it is there."""
        remove_if_there(self.tmp)
        _FINAL_NAMES.pop(self.tmp, None)


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yields a temporary path next to ``path``; once the body has written it, the file is
    flushed to disk and renamed over ``path`` (``atomic_paths`` of one path). On error the
    temporary file is removed; a lack of space raises a ``CheckpointError`` naming ``path``
    and what was free."""
    with atomic_paths([path]) as staged, staged[path].writing() as tmp:
        yield tmp


@contextlib.contextmanager
def atomic_paths(paths: Sequence[str]) -> Iterator[Dict[str, StagedFile]]:
    """Files replaced together: yields a ``StagedFile`` per path for the body to write
    (each through its ``writing()``); once the body is done every one is renamed into
    place, in ``paths``' order, so a reader that looks for the last one finds the others
    in place. On error none is: every temporary file is removed."""
    staged = {p: StagedFile(p) for p in paths}
    try:
        yield staged
    except BaseException:
        for file in staged.values():
            file.discard()
        raise
    for path in paths:
        staged[path].put_in_place()
