"""Checks that cannot pass on nothing.

``all()`` of an empty input is True, so a check over a filtered or computed collection
passes silently when the filter or the computation leaves nothing to check. ``every`` is
``all`` that fails on an empty input; ``parity.paired`` does the same for ``zip``.
"""
from typing import Iterable


def every(values: Iterable[object], what: str = "values") -> bool:
    """``all(values)``; an ``AssertionError`` if there were none."""
    checked = list(values)
    assert checked, f"no {what} to check: the check would pass on nothing"
    return all(checked)
