"""Checks that cannot pass on nothing.

``all()`` of an empty input is True, so a check over a filtered or computed collection
passes silently when the filter or the computation leaves nothing to check. ``every`` is
``all`` that fails on an empty input; ``pairs`` is ``zip`` that fails on empty inputs or
inputs of different lengths (``zip`` stops at the shorter and compares nothing past it).
A loop that asserts over an empty collection asserts nothing: ``nonempty`` is its
collection, as a list, once it is known to hold something.
"""
from typing import Iterable, Iterator, List, Tuple, TypeVar

T = TypeVar("T")


def every(values: Iterable[object], what: str = "values") -> bool:
    """``all(values)``; an ``AssertionError`` if there were none."""
    return all(nonempty(values, what))


def pairs(*sides: Iterable[object], what: str = "values") -> Iterator[Tuple[object, ...]]:
    """``zip(*sides)``, once every side is known to hold the same number of values, and some."""
    lists = [list(side) for side in sides]
    lengths = [len(side) for side in lists]
    assert len(set(lengths)) == 1, f"{what}: sides of lengths {lengths} compared pairwise"
    assert lengths[0], f"no {what} to check: the check would pass on nothing"
    return zip(*lists)


def nonempty(values: Iterable[T], what: str = "values") -> List[T]:
    """``list(values)``; an ``AssertionError`` if there were none."""
    checked = list(values)
    assert checked, f"no {what} to check: the check would pass on nothing"
    return checked
