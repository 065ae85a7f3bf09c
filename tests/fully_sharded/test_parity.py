"""FSDP at N = 1, 2, 4, 8 trains like the unsharded model on one device, step by step, in
every setting of ``tests/support/parity.py`` (bounds in its docstring).

Every rank compiles the same step graph: the launcher raises ``DivergentGraphs`` when a rank
other than 0 compiles at a collective point, so a passing launch proves it.
"""
import pytest
import torch

from xla_fsdp import launch

from ..support.parity import SETTINGS, compare, train


def _names(world):
    # groups of two need at least two groups; a setting may name the worlds it runs at
    return [n for n in SETTINGS if (SETTINGS[n][3].get("groups", 1) == 1 or world >= 4)
            and world in SETTINGS[n][3].get("worlds", (world,))]


@pytest.fixture(scope="module")
def reference():
    return launch(train, (list(SETTINGS), False), num_devices=1)[0]


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2,
                                   pytest.param(4, marks=pytest.mark.slow),
                                   pytest.param(8, marks=pytest.mark.slow)])
def test_parity_with_unsharded(reference, world):
    names = _names(world)
    results = launch(train, (names, True), num_devices=world)
    problems = []
    for name in names:
        problems += compare(name, results[0][name], reference[name])
        for rank in range(1, world):  # every rank holds the same full model
            for key, value in results[rank][name]["params"].items():
                if not torch.equal(value, results[0][name]["params"][key]):
                    problems.append(f"{name}: rank {rank} {key} differs from rank 0")
    assert not problems, "\n".join(problems)
