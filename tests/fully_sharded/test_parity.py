"""FSDP at N = 1, 2, 4, 8 trains like the unsharded model on one device, step by step, in
every setting of ``tests/support/parity.py``, within the suite's bounds ([Note: parity bounds]
in ``tests/support/bounds.py``), which are checked here too.

Every rank compiles the same step graph: the launcher raises ``DivergentGraphs`` when a rank
other than 0 compiles at a collective point, so a passing launch proves it.
"""
import pytest
import torch

from xla_fsdp import launch

from ..support.bounds import parameter_problems
from ..support.checks import nonempty
from ..support.models import Net, forward_in
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
    names = nonempty(_names(world), f"parity settings at N={world}")
    by_hardware = {}   # a launch builds its units for one hardware (see parity.SETTINGS)
    for name in names:
        by_hardware.setdefault(SETTINGS[name][3].get("hardware"), []).append(name)
    results = {rank: {} for rank in range(world)}
    for group in by_hardware.values():
        for rank, got in launch(train, (group, True), num_devices=world).items():
            results[rank].update(got)
    problems = []
    for name in names:
        problems += compare(name, results[0][name], reference[name])
        for rank in range(1, world):  # every rank holds the same full model
            for key, value in results[rank][name]["params"].items():
                if not torch.equal(value, results[0][name]["params"][key]):
                    problems.append(f"{name}: rank {rank} {key} differs from rank 0")
    assert not problems, "\n".join(problems)


def test_the_low_precision_reference_computes_as_a_bf16_unit_and_steps_float32_masters():
    torch.manual_seed(0)
    model, x = Net(batchnorm=True), torch.randn(4, 32)
    copy = Net(batchnorm=True).to(torch.bfloat16)
    copy.load_state_dict(model.state_dict())
    copy.bn.float()   # BatchNorm computes in float32, between bf16 neighbours
    copy.bn.register_forward_pre_hook(lambda _m, args: (args[0].float(),))
    copy.bn.register_forward_hook(lambda _m, _args, out: out.to(torch.bfloat16))
    got = forward_in(model, x, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, copy(x.to(torch.bfloat16)))
    got.float().sum().backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(forward_in(model, x), model(x))   # float32: the model itself


def test_the_bounds_catch_a_wrong_shard_in_either_precision():
    want = {"w": torch.zeros(20, 10)}
    shard = {"w": torch.zeros(20, 10).index_fill_(0, torch.arange(10), 2e-2)}  # a rank's rows
    flipped = {"w": torch.zeros(20, 10)}
    flipped["w"][0, 0] = 2e-2   # one weight of 200: an adaptive step taken the other way
    too_far = {"w": torch.zeros(20, 10)}
    too_far["w"][0, 0] = 5e-2
    for key in ("float32", "low"):
        assert parameter_problems(shard, want, key) and parameter_problems(
            shard, want, key, moved=4e-2), key
        assert parameter_problems(flipped, want, key), key   # SGD moves no weight so far
        assert parameter_problems(flipped, want, key, moved=4e-2) == [], key
        assert parameter_problems(too_far, want, key, moved=4e-2), key
    # two of a LayerNorm's 32 weights a step apart: bf16 rounding, float32 never
    norm = {"w": torch.zeros(32)}
    two = {"w": torch.zeros(32).index_fill_(0, torch.tensor([3, 17]), 2e-2)}
    assert parameter_problems(two, norm, "float32", moved=4e-2)
    assert parameter_problems(two, norm, "low", moved=4e-2) == []
