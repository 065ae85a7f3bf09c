"""Rank-ordered turn taking for device threads that share one Python process.

Virtual XLA:CPU devices are threads of a single process, so three things that separate
processes get for free have to be rebuilt here:

* Ranks must meet at every collective and dispatch it in a fixed order. Then rank 0
  compiles the graph and the others hit the shared compile cache, so every replica runs
  the same HLO module (XLA:CPU keys a collective's rendezvous by module id). And no rank
  blocks on its device while a peer still needs the GIL to dispatch its part.
* Each rank must own its RNG streams. The torch CPU generator, ``random`` and numpy are
  process-global; device threads drawing from them concurrently get different values per
  rank, in a different order on every run. The same holds for other process-wide state
  that code relies on (``process_globals``): the ring swaps each rank's copy in with its
  turn.
* One rank's failure must release all the others instead of leaving them waiting.

One token circulates in rank order and only its holder runs Python. A collective point
costs two laps: one in which every rank arrives, and one in which every rank dispatches.
Tracing is bound by the GIL anyway, so serialising it costs no parallelism; device
execution still overlaps freely.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, TypeVar

from .process_globals import ProcessGlobal, RngStreams

T = TypeVar("T")


class RankAborted(BaseException):
    """Unwinds a rank's thread after another rank failed.

    A BaseException so that user code's ``except Exception`` cannot swallow it."""


class CollectiveMismatch(RuntimeError):
    """Ranks reached different collective points, so their collectives could never meet."""


@dataclass(frozen=True)
class Arrival:
    kind: str  # what the rank is doing: "torch_xla.sync()", "rendezvous", "return", ...
    site: str  # where in user code, for the error message


_ASIDE = Arrival("waiting outside the ring", "")


class TurnRing:
    """A token passed 0, 1, ..., n-1, 0, ... among the ranks that have not returned.

    Each rank holds its own copy of ``process_globals`` (by default the RNG streams) while
    it holds the token."""

    def __init__(self, world_size: int,
                 process_globals: Optional[Sequence[ProcessGlobal]] = None,
                 at_meeting: Optional[Callable[[], None]] = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._cond = threading.Condition()
        self._holder: Optional[int] = 0
        self._finished = [False] * world_size
        self._failure: Optional[int] = None
        self._arrivals: List[Optional[Arrival]] = [None] * world_size
        self._dispatched = 0  # ranks that have dispatched at the current collective point
        self.first_to_dispatch = True  # during a dispatch: no rank has dispatched before it
        self._globals = (tuple(process_globals) if process_globals is not None
                         else (RngStreams(),))
        self._saved = [[g.fresh() for g in self._globals] for _ in range(world_size)]
        self._at_meeting = at_meeting  # run once per collective point, all ranks there

    # -- the token ---------------------------------------------------------------------
    def enter(self, rank: int) -> None:
        """Blocks until ``rank`` holds the token for the first time."""
        self._wait_turn(rank)

    def _wait_turn(self, rank: int) -> None:
        with self._cond:
            while self._holder != rank and self._failure is None:
                self._cond.wait()
            if self._failure is not None and self._failure != rank:
                raise RankAborted(f"rank {rank} stopped because rank {self._failure} failed")
        for piece, state in zip(self._globals, self._saved[rank]):
            piece.restore(state)

    def _pass_turn(self, rank: int) -> None:
        self._saved[rank] = [piece.capture() for piece in self._globals]
        with self._cond:
            self._holder = self._next_after(rank)
            self._cond.notify_all()

    def _next_after(self, rank: int) -> Optional[int]:
        for step in range(1, self.world_size + 1):
            candidate = (rank + step) % self.world_size
            if not self._finished[candidate]:
                return candidate
        return None

    def finish(self, rank: int) -> None:
        """``rank`` returned from its function; the token skips it from now on."""
        self._arrivals[rank] = Arrival("return from the launched function", "")
        self._finished[rank] = True
        self._pass_turn(rank)

    def fail(self, rank: int) -> None:
        """``rank`` raised: every rank still waiting for the token gets RankAborted."""
        with self._cond:
            if self._failure is None:
                self._failure = rank
            self._cond.notify_all()

    @property
    def failed_rank(self) -> Optional[int]:
        return self._failure

    def arrival(self, rank: int) -> Optional[Arrival]:
        """Where ``rank`` last arrived (None before it reached any collective point)."""
        return self._arrivals[rank]

    # -- collective points ---------------------------------------------------------------
    def collective(self, rank: int, kind: str, site: str, dispatch: Callable[[], T]) -> T:
        """Runs ``dispatch`` on every rank in rank order once all ranks have arrived.

        Returns only after every rank has dispatched, so the caller may then wait on its
        own device. Raises CollectiveMismatch if the ranks arrived at different points."""
        self._arrivals[rank] = Arrival(kind, site)
        self._pass_turn(rank)
        self._wait_turn(rank)
        while any(a is _ASIDE for a in self._arrivals):
            self._pass_turn(rank)  # a peer is waiting outside the ring: not all have arrived
            self._wait_turn(rank)
        self._check_arrivals(rank)
        self.first_to_dispatch = self._dispatched == 0
        if self.first_to_dispatch and self._at_meeting is not None:
            self._at_meeting()
        try:
            result = dispatch()
        finally:
            self._dispatched += 1
            if self._dispatched >= self._finished.count(False):
                self._dispatched = 0
        self._pass_turn(rank)
        self._wait_turn(rank)
        return result

    def step_aside(self, rank: int, wait: Callable[[], None]) -> None:
        """Runs ``wait`` (e.g. a sleep) without the token, so that every other rank can run
        up to its next collective point meanwhile, then takes the token back.

        For a rank that waits for what its peers do outside collectives, e.g. files they
        write. The peers' next collective point completes only once this rank arrives there
        too. Afterwards a peer may be the first to dispatch at a point, which
        ``first_to_dispatch`` tells."""
        self._arrivals[rank] = _ASIDE
        self._pass_turn(rank)
        try:
            wait()
        finally:
            self._wait_turn(rank)

    def _check_arrivals(self, rank: int) -> None:
        mine = self._arrivals[rank]
        odd = [r for r, a in enumerate(self._arrivals) if a is None or a.kind != mine.kind]
        if not odd:
            return
        lines = []
        for r, a in enumerate(self._arrivals):
            where = f" at {a.site}" if a is not None and a.site else ""
            lines.append(f"  rank {r}: {a.kind if a else 'has not started'}{where}")
        raise CollectiveMismatch(
            "ranks reached different collective points, so their collectives could never "
            "meet (on real hardware this hangs):\n" + "\n".join(lines) +
            "\nEvery rank must call torch_xla.sync(), xm.rendezvous() and wait_device_ops() "
            "the same number of times and in the same order, and must read values that "
            "depend on a collective (.item(), print, bool(tensor)) at the same points.")
