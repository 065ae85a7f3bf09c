"""How the ranks agree at a step boundary (to stop on a preemption, to publish a save that
every rank has written) without a rendezvous at every step.

[Note: a vote read two steps later]
Each rank learns of a preemption, or of its own write ending, at its own moment: on a pod
the processes receive SIGTERM at different times, and each rank's background write ends
when its disk is done. Acting on what one rank knows would split the ranks (one saves, the
others train on), so they vote: at every boundary each rank adds its counts to an
all-reduce over all ranks, and acts only on the sums, which are the same on every rank.

``xm.rendezvous`` would give the sums at once, but it synchronises the device and waits
for it, three times, at every step: the host could no longer trace step k+1 while the
device runs step k. Instead the ballot is an all-reduce started as a computation of its
own, not waited for, and read two boundaries after it was cast (``LAG``). By then the
device has run it, queued behind the step before, so reading it does not hold the host
back. Every rank reads the same ballot at the same boundary, so every rank decides the same
thing at the same step, two steps after the first rank knew. It is not added to the step's
graph: XLA refuses a module that mixes layout-pinned all-reduces (the default of
``xm.all_reduce``, which a training loop may use) with unpinned ones, and a ballot in the
step's graph would be pinned or not as the loop's are. What it costs per step: one small
program (an all-reduce of four integers) and a copy of them to the host.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Deque, List, Optional, Sequence, Tuple

import torch

from ..._sharding.collectives import sum_over_all_ranks
from ..._xla.private_api import fresh_collective_token, start_alone

LAG = 2


class StepVote:
    """One rank's ballots, in the order cast. Every rank casts at the same boundaries."""

    def __init__(self) -> None:
        self._ballots: Deque[Tuple[torch.Tensor, Any]] = deque()

    def cast(self, counts: Sequence[int], about: Any = None
             ) -> Optional[Tuple[List[int], Any]]:
        """Adds this rank's ``counts`` (non-negative integers) to the pending graph; returns
        every rank's counts summed for the ballot cast ``LAG`` boundaries ago, with the
        ``about`` it was cast with (None for the first ``LAG`` boundaries)."""
        import torch_xla
        local = torch.tensor(list(counts), dtype=torch.int32).to(torch_xla.device())
        with fresh_collective_token():  # not chained to the step's pending collectives
            sums = sum_over_all_ranks(local)
        start_alone([sums])
        self._ballots.append((sums, about))
        if len(self._ballots) <= LAG:
            return None
        sums, cast_about = self._ballots.popleft()
        return [int(v) for v in sums.cpu().tolist()], cast_about

    def forget(self) -> None:
        """Drops the ballots not read (every rank at the same boundary)."""
        self._ballots.clear()
