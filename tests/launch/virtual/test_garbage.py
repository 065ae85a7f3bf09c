"""The cycle collector of a virtual-device process, on plain Python objects: it runs only
when the turn ring's meeting hook says so, when due or owed. No XLA."""
import gc
import weakref

import pytest

from xla_fsdp.launch.virtual.garbage import CollectorAtMeetings


class Node:
    pass


def _cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def collector():
    enabled, threshold, callbacks = gc.isenabled(), gc.get_threshold(), list(gc.callbacks)
    c = CollectorAtMeetings()
    c.install()
    yield c
    gc.unfreeze()
    gc.callbacks[:] = callbacks
    gc.set_threshold(*threshold)
    if enabled:
        gc.enable()


def test_garbage_lives_until_a_meeting_finds_a_collection_due(collector):
    gc.set_threshold(50, 10, 10)
    dead = _cycle()
    collector.collect_if_due()                # nothing due yet
    assert dead() is not None
    junk = [Node() for _ in range(200)]       # would have triggered the automatic collector
    assert dead() is not None
    collector.collect_if_due()
    assert dead() is None
    del junk


def test_a_rank_collecting_itself_is_matched_at_the_next_meeting(collector):
    gc.set_threshold(10 ** 6, 10, 10)         # never due by allocations
    first = _cycle()
    gc.collect()                              # one rank's own call, inside its turn
    assert first() is None
    later = _cycle()                          # a peer's garbage after that call
    collector.collect_if_due()                # owed: the collection the call started
    assert later() is None
    again = _cycle()
    collector.collect_if_due()                # owed only once
    assert again() is not None
