"""The turn ring on plain threads: order, per-rank RNG and process globals, mismatches,
failures. No XLA."""
import random
import threading

import pytest
import torch

from xla_fsdp.launch.virtual.turn_ring import CollectiveMismatch, RankAborted, TurnRing


def run_ranks(world, body, process_globals=None, at_meeting=None):
    """Runs body(ring, rank) on `world` threads the way the launcher does."""
    ring = TurnRing(world, process_globals, at_meeting)
    outcome = {}

    def thread(rank):
        try:
            ring.enter(rank)
            outcome[rank] = body(ring, rank)
            ring.finish(rank)
        except RankAborted:
            outcome[rank] = "aborted"
        except BaseException as exc:  # noqa: B902 - recorded for the assertions
            outcome[rank] = exc
            ring.fail(rank)

    threads = [threading.Thread(target=thread, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return outcome


def test_segments_and_dispatches_run_in_rank_order():
    events = []

    def body(ring, rank):
        for step in range(3):
            events.append(("trace", step, rank))
            ring.collective(rank, "sync", "", lambda: events.append(("dispatch", step, rank)))
        return rank

    outcome = run_ranks(4, body, at_meeting=lambda: events.append("meeting"))
    assert outcome == {r: r for r in range(4)}
    expected = []
    for step in range(3):
        expected += [("trace", step, r) for r in range(4)]
        expected += ["meeting"]  # once every rank arrived, before any dispatches
        expected += [("dispatch", step, r) for r in range(4)]
    assert events == expected


def test_each_rank_owns_its_rng_streams():
    def body(ring, rank):
        draws = []
        for _ in range(3):
            draws.append((torch.rand(2).tolist(), random.random()))
            ring.collective(rank, "sync", "", lambda: None)
        torch.manual_seed(rank)
        ring.collective(rank, "sync", "", lambda: None)
        draws.append(torch.rand(1).item())
        return draws

    outcome = run_ranks(3, body)
    common = outcome[0][:3]
    for rank in range(3):
        assert outcome[rank][:3] == common  # same start, own stream: like fresh processes
        seeded = torch.rand(1, generator=torch.Generator().manual_seed(rank)).item()
        assert outcome[rank][3] == seeded  # a seed set by one rank stays with that rank


def test_different_collective_points_are_a_clear_error():
    def body(ring, rank):
        kind = "torch_xla.sync()" if rank == 0 else "xm.rendezvous()"
        ring.collective(rank, kind, f"train.py:{10 + rank}", lambda: None)

    outcome = run_ranks(2, body)
    errors = [v for v in outcome.values() if isinstance(v, CollectiveMismatch)]
    assert len(errors) == 1
    text = str(errors[0])
    assert "rank 0: torch_xla.sync() at train.py:10" in text
    assert "rank 1: xm.rendezvous() at train.py:11" in text
    assert "aborted" in outcome.values()


def test_a_rank_that_returns_early_is_reported_by_the_others():
    def body(ring, rank):
        if rank == 1:
            return "done"
        ring.collective(rank, "torch_xla.sync()", "", lambda: None)

    outcome = run_ranks(2, body)
    assert isinstance(outcome[0], CollectiveMismatch)
    assert "rank 1: return from the launched function" in str(outcome[0])


def test_failure_releases_ranks_waiting_anywhere():
    def body(ring, rank):
        for step in range(5):
            if rank == 2 and step == 3:
                raise KeyError("bad batch")
            ring.collective(rank, "sync", "", lambda: None)

    outcome = run_ranks(4, body)
    assert isinstance(outcome[2], KeyError)
    assert [outcome[r] for r in (0, 1, 3)] == ["aborted"] * 3


class ModuleGlobal:
    """A process global as ``process_globals`` sees one: a value the process holds."""
    value = "as the process left it"

    def fresh(self):
        return "fresh"

    def capture(self):
        return ModuleGlobal.value

    def restore(self, state):
        ModuleGlobal.value = state


def test_each_rank_holds_its_own_copy_of_a_process_global_in_its_turns():
    def body(ring, rank):
        seen = [ModuleGlobal.value]
        ModuleGlobal.value = f"set by rank {rank}"
        ring.collective(rank, "sync", "", lambda: seen.append(ModuleGlobal.value))
        ring.step_aside(rank, lambda: None)
        seen.append(ModuleGlobal.value)
        return seen

    outcome = run_ranks(3, body, process_globals=[ModuleGlobal()])
    for rank in range(3):
        assert outcome[rank] == ["fresh"] + [f"set by rank {rank}"] * 2


def test_world_size_must_be_positive():
    with pytest.raises(ValueError):
        TurnRing(0)


def test_a_rank_that_steps_aside_lets_the_others_reach_their_collective():
    written, events = set(), []

    def body(ring, rank):
        ring.collective(rank, "sync", "", lambda: None)
        if rank == 0:  # waits for what ranks 1..3 do before their next collective point
            while len(written) < 3:
                ring.step_aside(rank, lambda: None)
            events.append(("rank 0 saw", sorted(written)))
        else:
            written.add(rank)
        first = []
        ring.collective(rank, "sync", "", lambda: first.append(ring.first_to_dispatch))
        events.append(("dispatch", rank, first[0]))
        ring.collective(rank, "sync", "", lambda: None)
        return rank

    outcome = run_ranks(4, body)
    assert outcome == {r: r for r in range(4)}
    assert events[0] == ("rank 0 saw", [1, 2, 3])
    # the ranks that did not wait are now ahead in the ring: one of them dispatches first,
    # and exactly one rank is told it was first
    dispatches = [e for e in events if e[0] == "dispatch"]
    assert sorted(r for _, r, _ in dispatches) == [0, 1, 2, 3]
    assert [flag for _, _, flag in dispatches].count(True) == 1
