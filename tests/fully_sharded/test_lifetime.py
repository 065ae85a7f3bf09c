"""A wrapped model lives and dies like the model (one launch at N = 2).

* 20 rounds of build, train, evaluate and drop free everything: the live XLA tensors come
  back to the count the same loop leaves without FSDP, and no unit survives. Each round
  drops its model with a gather still pending (an evaluation forward with grad enabled and
  no backward), and rank 0 alone collects garbage, as the automatic collector would inside
  one rank's turn: the launcher's collection at collective points keeps the ranks' graphs
  equal (see [Note: collection at collective points]).
* The same holds for a model with a torch.compile'd unit, whose graph's inputs torch_xla
  keeps with FSDP's gradient hooks on them.
* An exception from user code inside a nested unit's forward, and another inside its
  backward, each caught by the loop (which then calls ``zero_grad``), leave the model
  usable: every later step's loss and the final parameters equal those of the unsharded
  model that never took the failed steps, and ``state_dict()`` works right after the
  failed backward (see [Note: a pass that raised]).
"""
import gc

import pytest
import torch
import torch.nn as nn

from xla_fsdp import launch

from ..support.checks import nonempty
from ..support.models import CLASSES, DIM, Block
from ..support.parity import paired

pytestmark = pytest.mark.slow  # one launch of many models: the full suite's

WORLD, ROUNDS, STEPS = 2, 20, 7
FAIL_FORWARD, FAIL_BACKWARD = 2, 4  # the steps whose forward, and backward, raise
SETTINGS = ({}, {"flatten_parameters": True}, {"reshard_after_forward": False})


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, switch):
        ctx.switch = switch
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.switch.backward:
            raise RuntimeError("injected failure in backward")
        return grad, None


class Switch(nn.Module):
    """Passes its input through; raises in forward or in backward when told to."""

    def __init__(self):
        super().__init__()
        self.forward_fails = self.backward = False

    def forward(self, x):
        if self.forward_fails:
            raise RuntimeError("injected failure in forward")
        return _RaiseInBackward.apply(x, self)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.b1 = Block()
        self.b2 = nn.Sequential(Block(), Switch(), Block())
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return self.head(self.b2(self.b1(self.inp(x))))


def _wrapped(**kwargs):
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    model = Model()
    model.b1, model.b2 = FSDP(model.b1, **kwargs), FSDP(model.b2, **kwargs)
    return FSDP(model, **kwargs)


def _live_xla_tensors():
    import torch_xla
    count = torch_xla._XLAC._xla_counter_value
    return (count("CreateXlaTensor") or 0) - (count("DestroyXlaTensor") or 0)


def _rounds(rank, wrap):
    """Live XLA tensors added by ROUNDS rounds of build, 2 steps, an evaluation and drop."""
    import torch_xla
    device = torch_xla.device()
    torch_xla.sync()
    gc.collect()
    torch_xla.sync()
    before = _live_xla_tensors()
    for r in range(ROUNDS):
        if wrap:
            model = _wrapped(**SETTINGS[r % len(SETTINGS)])
        else:
            torch.manual_seed(0)
            model = Model().to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):
            model(torch.randn(4, DIM, device=device)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
        evaluation = model(torch.randn(4, DIM, device=device)).sum()  # never backwarded
        del model, optimizer, evaluation
        if rank == 0:
            gc.collect()
        torch_xla.sync()
    gc.collect()
    torch_xla.sync()
    return _live_xla_tensors() - before


def _train_through_failures(rank):
    """Losses of every step that did not fail and the final parameters, with the failures
    injected (FSDP) or the failed steps left out (unsharded)."""
    import torch_xla
    device = torch_xla.device()
    out = {}
    for name in ("fsdp", "fsdp_offload", "plain"):
        if name.startswith("fsdp"):
            # offloaded: the gradients reduced before the failure never reach the host
            model = _wrapped(offload_optimizer=name == "fsdp_offload")
        else:
            torch.manual_seed(0)
            model = Model().to(device)
        switch = next(m for m in model.modules() if isinstance(m, Switch))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, after_failure = [], None
        for step in range(STEPS):
            torch.manual_seed(100 + step)  # the same batch on every rank and in both runs
            x = torch.randn(8, DIM).to(device)
            failing = name != "plain" and step in (FAIL_FORWARD, FAIL_BACKWARD)
            if name == "plain" and step in (FAIL_FORWARD, FAIL_BACKWARD):
                continue
            switch.forward_fails = failing and step == FAIL_FORWARD
            switch.backward = failing and step == FAIL_BACKWARD
            try:
                loss = model(x).square().mean()
                loss.backward()
            except RuntimeError as exc:
                if "injected failure" not in str(exc):
                    raise
                optimizer.zero_grad()
                if step == FAIL_BACKWARD:  # a call that needs the model idle
                    after_failure = sorted(model.full_state_dict(rank0_only=False))
                torch_xla.sync()
                continue
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
            losses.append(loss.item())
        params = (model.full_state_dict(rank0_only=False) if name != "plain" else
                  {k: v.detach().cpu() for k, v in model.state_dict().items()})
        out[name] = {"losses": losses, "params": params, "after_failure": after_failure}
    return out


def _compiled_round():
    """A model whose blocks are torch.compile'd units, trained a step and dropped: torch_xla's
    compile bridge keeps the compiled graph's inputs, which carry FSDP's gradient hooks."""
    import torch_xla
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    model = Model()
    # b1's output, hooked by its unit, is an input of b2's compiled graph
    model.b1 = FSDP(torch.compile(model.b1, backend="openxla"))
    model.b2 = FSDP(torch.compile(model.b2, backend="openxla"))
    model = FSDP(model)
    model(torch.randn(4, DIM, device=torch_xla.device())).sum().backward()
    torch_xla.sync()


def _lifetime(rank):
    import torch_xla
    from xla_fsdp import FSDP
    plain = _rounds(rank, wrap=False)
    wrapped = _rounds(rank, wrap=True)
    _compiled_round()
    torch_xla.sync()  # every rank has returned from it
    gc.collect()
    units = sum(isinstance(o, FSDP) for o in gc.get_objects())
    return {"plain": plain, "wrapped": wrapped, "units": units,
            "failures": _train_through_failures(rank)}


@pytest.fixture(scope="module")
def results():
    return launch(_lifetime, (), num_devices=WORLD)


def test_dropped_models_are_freed(results):
    # rank 0 reads while its peer waits at the same point, so it sees every rank's tensors
    got = results[0]
    assert got["units"] == 0
    assert got["wrapped"] == got["plain"], \
        f"{ROUNDS} rounds left {got['wrapped']} live XLA tensors, {got['plain']} without FSDP"


def test_a_failed_forward_or_backward_leaves_the_model_usable(results):
    for rank, got in nonempty(results.items(), "ranks"):
        ref = got["failures"]["plain"]
        for name in ("fsdp", "fsdp_offload"):
            run = got["failures"][name]
            assert len(run["losses"]) == len(ref["losses"]) == STEPS - 2
            for step, (a, b) in paired(run["losses"], ref["losses"]):
                assert abs(a - b) <= 1e-5 * abs(b), f"{name} rank {rank}, step {step}: {a} vs {b}"
            assert run["params"].keys() == ref["params"].keys()
            for key, want in nonempty(ref["params"].items(), "parameters"):
                assert torch.allclose(run["params"][key], want, rtol=1e-5, atol=1e-6), \
                    (name, key)
            assert run["after_failure"] == sorted(ref["params"])
