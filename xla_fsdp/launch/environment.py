"""Environment variables set for a while and put back: for a child process that must be
born with them (XLA reads them when its runtime starts), and for tests."""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterable, Iterator, Mapping

_LOCK = threading.Lock()


@contextlib.contextmanager
def restored_environment(names: Iterable[str]) -> Iterator[None]:
    """Puts the variables ``names`` back as they were (set or not) when the body ends."""
    saved = {k: os.environ.get(k) for k in names}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def environment_for_child(values: Mapping[str, str]) -> Iterator[None]:
    """Sets ``values`` for the body, in which the caller starts a child process. Threads
    that start children at the same time take turns, so that no child gets another's."""
    with _LOCK, restored_environment(values):
        os.environ.update(values)
        yield
