"""Real Hugging Face architectures (GPT-2, Llama with grouped-query attention, Qwen2, BERT,
T5) and a mixture-of-experts model of our own, trained with FSDP at N = 2 and 4 against the
same model trained unsharded on the global batch, step by step.

Per architecture and N:
(a) every step's loss within 1e-5 relative of the reference's;
(b) every entry of the reference's state dict within 1e-5 of the gathered full state dict
    (fp32 and SGD + momentum, as in the parity settings: the sharded run differs
    only in how the gradient sums are ordered);
(c) ``full_state_dict()`` has exactly the plain model's ``state_dict()`` keys and loads into
    a fresh plain model with ``strict=True``;
(d) the per-rank checkpoint written by ``save_sharded`` consolidates into a state dict that
    loads into a fresh plain model with ``strict=True`` and equals the reference's.

One launch on one device trains every architecture unsharded; one launch per N trains them
all sharded, each rank comparing its gathered model with that reference.
"""
import time

import pytest
import torch

from xla_fsdp import launch
from xla_fsdp.checkpoint.consolidate.library import consolidate_checkpoint_files

from ..support.bounds import LOSS, PARAM
from ..support.checks import nonempty
from ..support.hf_architectures import (ARCHITECTURES, EXPERTS, GLOBAL_BATCH, STEPS, build,
                                        moe_batch, rank_slice, tokens_per_expert,
                                        train_and_compare, train_unsharded)
from ..support.parity import paired

pytestmark = pytest.mark.slow

LOSS_BOUND, PARAM_BOUND = LOSS["float32"], PARAM["float32"]   # [Note: parity bounds]
# compiled with the suite's fast flags (tests/conftest.py)
WORLDS = [2, 4]
NAMES = list(ARCHITECTURES)


@pytest.fixture(scope="module")
def references():
    return launch(train_unsharded, (NAMES,), num_devices=1)[0]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"N{n}")
def launched(request, tmp_path_factory, references):
    world = request.param
    ckpt_dir = tmp_path_factory.mktemp(f"hf_ckpt_n{world}")
    start = time.monotonic()
    results = launch(train_and_compare, (NAMES, str(ckpt_dir), references), num_devices=world)
    print(f"\nlaunch at N={world}: {time.monotonic() - start:.1f} s")
    return world, results


def _training_problems(name, world, results):
    problems, loss_diff, param_diff = [], 0.0, 0.0
    for rank in range(world):
        got = results[rank][name]
        if "error" in got:
            problems.append(f"rank {rank} raised:\n{got['error']}")
            continue
        for step, (a, b) in paired(got["losses"], got["plain_losses"]):
            loss_diff = max(loss_diff, abs(a - b) / abs(b))
            if abs(a - b) > LOSS_BOUND * abs(b):
                problems.append(f"rank {rank} step {step}: loss {a:.7g}, unsharded {b:.7g}")
        for key, diff in got["diffs"].items():
            param_diff = max(param_diff, diff)
            if not diff <= PARAM_BOUND:
                problems.append(f"rank {rank}: {key} differs from unsharded by {diff:.3g}")
        if got["missing"]:
            problems.append(f"rank {rank}: full_state_dict() lacks {got['missing']}")
    return problems, loss_diff, param_diff


def _strict_load(name, state_dict, what):
    try:
        build(name).load_state_dict(state_dict, strict=True)
    except Exception as exc:  # noqa: BLE001 - reported with the other problems
        return [f"{what} does not load strictly into the plain model: {exc}"]
    return []


def _state_dict_problems(name, got):
    full_sd, plain_sd = got["full_sd"], got["plain_sd"]
    expected = set(build(name).state_dict())
    assert set(plain_sd) == expected, "the reference moved to XLA changed its own keys"
    problems = []
    if set(full_sd) != expected:
        problems.append(f"full_state_dict() keys differ from the plain model's state_dict(): "
                        f"missing {sorted(expected - set(full_sd))}, "
                        f"extra {sorted(set(full_sd) - expected)}")
    return problems + _strict_load(name, full_sd, "full_state_dict()")


def _checkpoint_problems(name, got):
    try:
        _, path = consolidate_checkpoint_files(got["ckpt_prefix"], "_rank-*-of-*.pth",
                                               save_model=True, wait_seconds=0)
        consolidated = torch.load(path, map_location="cpu", weights_only=True)["model"]
    except Exception as exc:  # noqa: BLE001
        return [f"consolidation failed: {type(exc).__name__}: {exc}"]
    problems = _strict_load(name, consolidated, "the consolidated checkpoint")
    for key, ref in got["plain_sd"].items():
        if key not in consolidated:
            problems.append(f"the consolidated checkpoint lacks {key}")
        elif not (consolidated[key].double() - ref.double()).abs().max() <= PARAM_BOUND:
            problems.append(f"consolidated {key} differs from unsharded")
    return problems


def _routing_problems(world, results):
    """The model routed each rank's slice exactly as the data says (see MoEBlock)."""
    problems = []
    for rank in range(world):
        routing = results[rank]["moe"]["routing"]
        for step in range(STEPS):
            local = rank_slice(moe_batch("moe", step), rank, world)["input_ids"]
            want = tokens_per_expert(local)
            for layer, counts in enumerate(routing[step]):
                if not torch.equal(counts.long(), want):
                    problems.append(f"rank {rank} step {step} layer {layer}: routed "
                                    f"{counts.tolist()} tokens per expert, the data says "
                                    f"{want.tolist()}")
    return problems


@pytest.mark.parametrize("world", WORLDS)
def test_moe_data_leaves_experts_without_tokens_on_some_ranks(world):
    for step in nonempty(range(STEPS), "steps"):
        batch = moe_batch("moe", step)
        assert (tokens_per_expert(batch["input_ids"]) > 0).all(), \
            f"step {step}: every expert must get tokens from the global batch"
        idle = [(rank, e) for rank in range(world)
                for e, n in enumerate(tokens_per_expert(
                    rank_slice(batch, rank, world)["input_ids"]).tolist()) if n == 0]
        assert idle, f"step {step}: at N={world} every rank's slice reaches every expert"
        assert len(idle) < world * EXPERTS


@pytest.mark.parametrize("name", NAMES)
def test_hf_parity(launched, name):
    world, results = launched
    assert GLOBAL_BATCH % world == 0
    problems, loss_diff, param_diff = _training_problems(name, world, results)
    rank0 = results[0][name]
    if "error" not in rank0:
        problems += _state_dict_problems(name, rank0)
        problems += _checkpoint_problems(name, rank0)
        if name == "moe":
            problems += _routing_problems(world, results)
    print(f"\n{name} N={world}: max loss diff {loss_diff:.3g} (relative), "
          f"max param diff {param_diff:.3g}, {len(problems)} problem(s)")
    assert not problems, f"{name} at N={world}:\n" + "\n".join(problems)
