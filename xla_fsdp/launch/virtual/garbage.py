"""Python's cycle collector in a virtual-device process: it runs only where every rank
stands at the same point of its program.

[Note: collection at collective points]
An XLA tensor that dies takes its pending computation out of the next graph its rank
traces. Objects in reference cycles (a dropped model: modules, hooks, unit states, shards)
die when the cycle collector runs. In a process of its own a rank collects at points of its
own program. Here the ranks are threads of one process, and the collector runs whenever the
process's allocations cross a threshold: inside one rank's turn, freeing the garbage every
rank has made so far, each at a different point of its program. A dropped model's pending
gathers then leave one rank's graph and stay in another's, whose collectives never meet
(``DivergentGraphs``).

So the worker switches the automatic collector off (after freezing what the process holds
before any rank runs, which later collections then skip) and collects at collective
points, once every rank has arrived and before any dispatches: each rank's garbage made
before that point dies there, on every rank alike. A collection is made there when the
thresholds say one is due, as the automatic collector would, and also when some rank
called ``gc.collect()`` itself since the last point: that call freed the garbage of ranks
that had gone further in their turn than it had, and the collection at the point frees the
others' up to the same place.
"""
from __future__ import annotations

import gc
from typing import Any, Dict


class CollectorAtMeetings:
    """Installed once per virtual-device process; ``collect_if_due`` is the turn ring's
    meeting hook."""

    def __init__(self) -> None:
        self._owed = -1           # the oldest generation a rank collected since the last point
        self._collecting = False

    def install(self) -> None:
        gc.collect()
        gc.freeze()
        gc.disable()
        gc.callbacks.append(self._noted)

    def _noted(self, phase: str, info: Dict[str, Any]) -> None:
        if phase == "start" and not self._collecting:
            self._owed = max(self._owed, info["generation"])

    def collect_if_due(self) -> None:
        generation = max(self._owed, _due_generation())
        if generation < 0:
            return
        self._collecting = True
        try:
            gc.collect(generation)
        finally:
            self._collecting = False
            self._owed = -1


def _due_generation() -> int:
    """The generation the automatic collector would collect now, or -1 (CPython collects
    the oldest generation whose count exceeds its threshold)."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    return next((g for g in (2, 1, 0) if thresholds[g] and counts[g] > thresholds[g]), -1)
