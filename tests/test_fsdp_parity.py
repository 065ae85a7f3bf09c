"""FSDP at N = 1, 2, 4, 8 trains like the unsharded model on one device, step by step.

Bounds (fp32): every loss within 1e-5 relative and, with SGD + momentum, every parameter
within 1e-5. With AdamW the loss is held to 1e-5, but a parameter may differ by up to
2 * lr per step: Adam divides by sqrt(v), so a gradient that is zero up to rounding can
move a weight by anything up to lr in either run. The bound is 2 * lr * steps, and most
weights must still agree to 1e-5. bf16 compute rounds every matmul input to 8 bits
(relative 2^-8 = 3.9e-3), so it is held to 3e-2 on the loss and 5e-2 on the weights.

Every rank compiles the same step graph: the launcher raises ``DivergentGraphs`` when a rank
other than 0 compiles at a collective point, so a passing launch proves it.
"""
import pytest
import torch

from xla_fsdp import launch

from .fsdp_settings import SETTINGS, STEPS, train

ADAM_LR = 1e-3


def _names(world):
    # groups of two need at least two groups
    return [n for n in SETTINGS if SETTINGS[n][3].get("groups", 1) == 1 or world >= 4]


@pytest.fixture(scope="module")
def reference():
    return launch(train, (list(SETTINGS), False), num_devices=1)[0]


def _compare(name, got, ref):
    _, kwargs, opt, _ = SETTINGS[name]
    bf16 = kwargs.get("compute_dtype") == torch.bfloat16
    loss_bound, param_bound = (3e-2, 5e-2) if bf16 else (1e-5, 1e-5)
    problems = []
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        if abs(a - b) > loss_bound * abs(b):
            problems.append(f"{name}: step {step} loss {a:.7g} vs {b:.7g}")
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
        if abs(a - b) > loss_bound * abs(b):
            problems.append(f"{name}: step {step} total grad norm {a:.7g} vs {b:.7g}")
    assert len(got["norms"]) == len(ref["norms"])
    assert set(got["params"]) == set(ref["params"]), (name, set(got["params"]) ^ set(ref["params"]))
    for key, r in ref["params"].items():
        diff = (got["params"][key] - r).abs()
        if opt == "adamw" and not bf16:
            if diff.max() > 2 * ADAM_LR * STEPS or (diff > 1e-5).float().mean() > 0.01:
                problems.append(f"{name}: {key} max diff {diff.max():.3g}, "
                                f"{(diff > 1e-5).float().mean():.2%} beyond 1e-5")
        elif diff.max() > param_bound:
            problems.append(f"{name}: {key} max diff {diff.max():.3g}")
    for key, r in ref["buffers"].items():
        if got["buffers"][key].dtype != r.dtype:
            problems.append(f"{name}: buffer {key} is {got['buffers'][key].dtype}, not {r.dtype}")
        # running statistics of bf16 activations carry the activations' rounding
        if (got["buffers"][key].float() - r.float()).abs().max() > (param_bound if bf16 else 1e-5):
            problems.append(f"{name}: buffer {key} differs")
    if got["new_graphs"]:
        problems.append(f"{name}: {got['new_graphs']} graphs compiled after step 2")
    return problems


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_parity_with_unsharded(reference, world):
    names = _names(world)
    results = launch(train, (names, True), num_devices=world)
    problems = []
    for name in names:
        problems += _compare(name, results[0][name], reference[name])
        for rank in range(1, world):  # every rank holds the same full model
            for key, value in results[rank][name]["params"].items():
                if not torch.equal(value, results[0][name]["params"][key]):
                    problems.append(f"{name}: rank {rank} {key} differs from rank 0")
    assert not problems, "\n".join(problems)
