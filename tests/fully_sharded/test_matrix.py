"""The matrix of ``tests/support/matrix.py``: every way users wrap, configure and optimize a
model, and save and resume it, either trains like the unsharded model or is refused as
``REFUSALS`` expects ([Note: covering the matrix])."""
import itertools

import pytest

from ..support import matrix
from ..support.checks import every, nonempty


def test_the_covering_meets_every_pair_of_values():
    for axes, size in ((matrix.AXES, 70), (matrix.SUITE_AXES, 63)):
        cells = matrix.covering(axes)
        met = {pair for cell in cells for pair in matrix._pairs(cell._asdict())}
        assert met == matrix.all_pairs(axes)
        biggest = sorted(map(len, axes.values()))[-2:]
        assert len(cells) == biggest[0] * biggest[1] == size
        assert len(set(cells)) == len(cells)
    # any values, as the script's selections give them
    axes = dict(recipe="ab", option="pqrs", optimizer="xyz", foreach=(True,), format="kl",
                resumed_at="mn")
    met = {pair for cell in matrix.covering(axes) for pair in matrix._pairs(cell._asdict())}
    assert met == matrix.all_pairs(axes)


def test_every_refusal_names_values_on_the_axes():
    for pattern, words in nonempty(matrix.REFUSALS, "refusals"):
        assert words
        for axis, value in nonempty(pattern.items(), "axes of a refusal's pattern"):
            assert value in matrix.AXES[axis], (axis, value)
    adafactor = matrix.Cell("moved_first", "sharding_groups", "Adafactor", False, "dcp", "same")
    assert matrix.expected_refusal(adafactor)
    assert matrix.expected_refusal(adafactor._replace(optimizer="AdamW")) == ""
    assert every(matrix.expected_refusal(matrix.Cell(*values)) == "" for values in
                 itertools.product(matrix.RECIPES, matrix.OPTIONS, ["SGD", "AdamW"],
                                 (False, True), matrix.FORMATS, ("same", "other")))


@pytest.mark.slow
def test_every_cell_matches_or_is_refused():
    outcomes, failures = matrix.run(matrix.covering(matrix.SUITE_AXES))
    assert not failures, "\n".join(f"{cell}: {'; '.join(problems)}"
                                   for cell, problems in failures.items())
    refused = [c for c, outcome in outcomes.items() if "refused" in outcome]
    assert refused, "no cell was refused: REFUSALS no longer describes the wrapper"


def _refused_with_work_held_on_one_rank(rank):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    held = []

    def refused_step(cell):
        # the pending work of a refused step, a collective in it; rank 1 still holds a
        # tensor of it at the cell's end, as autograd's device thread sometimes does
        pending = xm.all_reduce(xm.REDUCE_SUM, torch.ones(4).to(torch_xla.device()))
        if rank == 1:
            held.append(pending)
        return {"refused": "training: refused"}

    def trained(cell):
        return {"loss": xm.all_reduce(xm.REDUCE_SUM, torch.ones(2).to(torch_xla.device()))
                .sum().item()}
    return matrix._each(rank, ["refused", "next"],
                        lambda c: refused_step(c) if c == "refused" else trained(c), "training")


def test_a_refused_cell_leaves_no_work_pending_on_any_rank():
    from xla_fsdp import launch
    out = launch(_refused_with_work_held_on_one_rank, num_devices=2)
    assert [o["next"]["loss"] for o in out.values()] == [4.0, 4.0]
