"""Which of FSDP's collectives wait on one another in the program torch_xla builds (see
[Note: collectives off the token chain]): launches at N = 2 read the HLO of a three-unit
model's forward and backward before it runs.

An all-gather must depend on no other collective, or XLA can neither overlap nor combine
them, nor be pinned (libtpu runs no pinned gather asynchronously); off a TPU a reduce-scatter
must depend on the one before it, or XLA combines a backward's reductions and holds every
unit's full gradient at once. On a TPU no collective carries torch_xla's token (see [Note: no
collective token on a TPU]): the reductions stay pinned, and nothing is added to their input.
"""
import re
from typing import Dict, List, Set, Tuple

import pytest
import torch
import torch.nn as nn

from xla_fsdp import launch
from xla_fsdp._unit.options import hardware_defaults

from ..support.checks import every, nonempty, pairs

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce")


def _dependencies(hlo: str) -> Dict[str, Tuple[str, bool, List[str]]]:
    """The entry computation's instructions: name -> (op, whether its result is a scalar,
    operand names)."""
    entry = hlo[hlo.index("\nENTRY"):]
    graph = {}
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.-]+) = (\(.*?\)|\S+) ([a-z-]+)\((.*)", line)
        if m:
            graph[m.group(1)] = (m.group(3), m.group(2).endswith("[]"),
                                 re.findall(r"%([\w.-]+)", m.group(4)))
    return graph


def _token_upstream(graph, name: str) -> Set[str]:
    """The collectives ``name`` waits on through a scalar: torch_xla's token, made from one
    element of a collective's result. (Data reaches a collective through whole tensors:
    the optimization barriers that order FSDP's units, which the token is not needed for.)"""
    seen, stack, found = set(), [(n, False) for n in graph[name][2]], set()
    while stack:
        n, via_scalar = stack.pop()
        if (n, via_scalar) in seen or n not in graph:
            continue
        seen.add((n, via_scalar))
        op, scalar, operands = graph[n]
        if op in COLLECTIVES and via_scalar:
            found.add(n)
        stack.extend((o, via_scalar or scalar) for o in operands)
    return found


# torch_xla's pinned and unpinned collectives, and the program a TPU gets by default: row
# blocks gathered in one unpinned all-gather per unit (see [Note: defaults that depend on the
# hardware])
SETTINGS = {"pinned": {"pin_layout_in_collective_ops": True},
            "unpinned": {"pin_layout_in_collective_ops": False},
            "tpu_defaults": hardware_defaults("TPU")}


def trace(rank):
    return [_trace(options) for options in SETTINGS.values()]


def trace_as_tpu(rank):
    """The same step as a TPU runs it: the TPU's defaults, and the process's collectives
    without torch_xla's token (set by the first unit built)."""
    from xla_fsdp._xla.hardware import plan_for
    from xla_fsdp._xla.private_api import collective_token_added
    plan_for("TPU")
    traced = _trace({})
    return traced, collective_token_added()


def _trace(options):
    import torch_xla
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    device = torch_xla.device()
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16),
                          nn.Linear(16, 4))
    for i in (1, 2):
        model[i] = FSDP(model[i], **options)
    root = FSDP(model, **options)
    loss = root(torch.randn(2, 8).to(device)).pow(2).sum()
    forward = torch_xla._XLAC._get_xla_tensors_hlo([loss])
    loss.backward()
    grads = [p.grad for p in root.parameters()]
    backward = torch_xla._XLAC._get_xla_tensors_hlo(grads)
    # the user's own collective in the same step: torch_xla's default, layout pinned
    import torch_xla.core.xla_model as xm
    total = xm.all_reduce(xm.REDUCE_SUM, loss.detach())
    opt = torch.optim.SGD(root.parameters(), lr=0.1)
    opt.step()
    torch_xla.sync()
    after = root(torch.randn(2, 8).to(device)).pow(2).sum()
    torch_xla.sync()
    return forward, backward, loss.item(), total.item(), after.item()


@pytest.fixture(scope="module")
def traced():
    return dict(zip(SETTINGS, launch(trace, num_devices=2)[0], strict=True))


def test_all_gathers_wait_on_no_collective_and_reduce_scatters_on_the_one_before(traced):
    """And a step that also calls ``xm.all_reduce`` (pinned, torch_xla's default) compiles
    and trains the same, with FSDP's collectives pinned, unpinned or in a TPU's layout."""
    first = traced["pinned"]
    for name, (forward, backward, loss, total, after) in nonempty(traced.items(), "settings"):
        pin_layout = SETTINGS[name].get("pin_layout_in_collective_ops", True)
        assert total == pytest.approx(2 * loss, rel=1e-6), (name, loss, total)
        assert after == after and after != loss, (name, loss, after)
        assert (loss, after) == pytest.approx((first[2], first[4]), rel=1e-6), \
            (name, loss, after)
        graph = _dependencies(forward)
        gathers = [n for n, (op, *_) in graph.items() if op == "all-gather"]
        assert len(gathers) >= 3, (name, gathers)
        for g in nonempty(gathers, "all-gathers"):
            assert not _token_upstream(graph, g), (name, g)
        # rank-1 pieces and a unit's coalesced gather: never pinned (see [Note: a rank-1
        # gather needs no pinned layout]); the reductions keep the option's pin
        assert not re.search(r"all-gather\(.*constrain_layout=true", forward), name
        assert bool(re.search(r"reduce-scatter\(.*constrain_layout=true", backward)) \
            == pin_layout
        graph = _dependencies(backward)
        scatters = [n for n, (op, *_) in graph.items() if op == "reduce-scatter"]
        assert len(scatters) >= 3, (name, scatters)
        chained = sorted(len(_token_upstream(graph, s) & set(scatters)) for s in scatters)
        assert chained == list(range(len(scatters))), (name, chained)


def test_on_a_tpu_no_collective_carries_the_token_and_the_step_trains_the_same(traced):
    """The TPU's step: no collective waits on another through torch_xla's token, none adds
    it to its input, and the reductions keep their pinned layout; with the user's
    ``xm.all_reduce`` in the same step it trains as the token-chained pinned step does.
    Without the switch every reduce-scatter's input is the gradient plus the token."""
    pinned = traced["pinned"]
    (forward, backward, loss, total, after), token_added = launch(trace_as_tpu,
                                                                  num_devices=2)[0]
    assert not token_added
    assert total == pytest.approx(2 * loss, rel=1e-6), (loss, total)
    assert (loss, after) == pytest.approx((pinned[2], pinned[4]), rel=1e-6), (loss, after)
    assert re.search(r"reduce-scatter\(.*constrain_layout=true", backward)
    for hlo in (forward, backward):
        graph = _dependencies(hlo)
        collectives = [n for n, (op, *_) in graph.items() if op in COLLECTIVES]
        assert collectives, hlo
        for c in nonempty(collectives, "collectives"):
            assert not _token_upstream(graph, c), c
    graph = _dependencies(backward)
    scatters = [n for n, (op, *_) in graph.items() if op == "reduce-scatter"]
    assert len(scatters) >= 3, scatters
    for s in nonempty(scatters, "reduce-scatters"):
        assert every(graph[o][0] != "add" for o in graph[s][2] if o in graph), (s, graph[s][2])


def _built_after_a_collective(rank):
    import warnings
    from xla_fsdp import FSDP
    from xla_fsdp._xla.hardware import plan_for
    from xla_fsdp._xla.private_api import collective_token_added
    first = collective_token_added()   # lowers a collective: torch_xla reads its switch now
    plan_for("TPU")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP(nn.Linear(4, 4))
    return first, collective_token_added(), [str(w.message) for w in caught]


def test_a_collective_lowered_before_the_first_unit_keeps_the_token_and_says_so():
    first, after, messages = launch(_built_after_a_collective, num_devices=1)[0]
    assert first and after
    assert [m for m in messages if "DISABLE_NUMERIC_CC_TOKEN=1" in m], messages


def test_a_bucket_mixing_dtypes_scales_each_input_as_it_was_prepared():
    """A float32 shard group (a module kept in float32 under bf16 compute) and a bf16 one in
    one bucket: each is averaged over the ranks as when it is reduced alone, whichever comes
    first. bf16 sums are pre-divided, float32 ones are not, so one scale for the bucket would
    leave one of them off by the pre-divide factor."""
    from xla_fsdp._sharding.collectives import padded_gradient, scatter_gradients
    from xla_fsdp._sharding.layout import FlatLayout
    from ..support.fake_collectives import FakeCollectives

    world, divide = 4, (2.0, 2.0)
    layout = FlatLayout((torch.Size([8]),), world, 1)
    grad = torch.arange(8.0)

    def reduce(*dtypes):
        collectives = FakeCollectives(world, 0, lambda: [], peer_scale=1.0)
        inputs = [padded_gradient(layout, [grad.to(d)], d, torch.device("cpu"), False, divide)
                  for d in dtypes]
        return scatter_gradients(collectives, divide, inputs, None)

    average = grad[:2]  # every rank reduces the same gradient: the average is its own block
    for dtypes in [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]:
        together = reduce(*dtypes)
        for dtype, reduced in pairs(dtypes, together, what="reduced gradients"):
            assert torch.equal(reduced, reduce(dtype)[0]), dtype
            assert torch.equal(reduced, average), (dtype, reduced)
