"""The harness of the pattern scenarios (``pattern_scenarios.py``): a wrapped model and its
unsharded reference trained side by side, problems collected instead of assertions, and
the comparisons.
"""
from __future__ import annotations

import copy
import os
import traceback
from typing import Callable, List

import torch
import torch.nn as nn

from .models import GLOBAL_BATCH, batch, loss_fn

WORLD = 2
TOL = 1e-5  # fp32: relative on losses, absolute on parameters and outputs
_LIST_AT_MOST = 6


# -- wrapping -------------------------------------------------------------------------------
def wrap_blocks(model):
    from xla_fsdp import FSDP
    model.b1 = FSDP(model.b1)
    model.b2 = FSDP(model.b2)
    return FSDP(model)


def wrap_grouped(model):
    from xla_fsdp import FSDP
    FSDP([model.inp, model.extra])  # attached (and kept) by the root built below
    model.b1 = FSDP(model.b1)
    return FSDP(model)


def placeholder(model, name):
    """The tensor a wrapped model's module holds under the unwrapped parameter ``name``."""
    obj = model
    for part in name.split("."):
        obj = getattr(obj, part)  # a unit forwards unknown attributes to its wrapped module
    return obj


def sgd(params):
    # no momentum: its first step would be a graph of its own, and every graph compiled
    # costs about a second and a half of the launch; parameters are compared right after
    # the steps that matter instead
    return torch.optim.SGD(list(params), lr=0.1)


def seeded(seed, build):
    torch.manual_seed(seed)
    return build()


# -- one scenario's run ---------------------------------------------------------------------
class Context:
    def __init__(self, rank, device, problems, extra):
        self.rank, self.device, self.problems, self.extra = rank, device, problems, extra
        self.pairs = []  # every Pair built, retired when the scenario or part ends

    def problem(self, text):
        self.problems.append(text)

    def part(self, label, fn):
        """Runs ``fn(ctx)`` as a part of its own: its exception ends only the part."""
        sub = Context(self.rank, self.device, [], self.extra)
        try:
            fn(sub)
        except Exception as exc:
            sub.problems.append(f"raised {describe(exc)}")
        for pair in sub.pairs:
            pair.retire()
        self.problems.extend(f"[{label}] {p}" for p in sub.problems)

    def attempt(self, what, fn):
        """``fn()``, or None and a problem naming ``what`` if it raises."""
        try:
            return fn(), True
        except Exception as exc:
            self.problem(f"{what} raised {describe(exc)}")
            return None, False


class Pair:
    """A wrapped model and its unsharded reference, built from the same initial values."""

    def __init__(self, ctx: Context, build: Callable[[], nn.Module],
                 wrap: Callable[[nn.Module], nn.Module] = wrap_blocks, kind: str = "net",
                 optimizers: bool = True):
        self.ctx, self.kind = ctx, kind
        self.opt = self.plain_opt = None
        ctx.pairs.append(self)
        cpu = seeded(0, build)
        # every attribute name, aliases included: each must hold a placeholder
        self.names = [n for n, _ in cpu.named_parameters(remove_duplicate=False)]
        self.plain = copy.deepcopy(cpu).to(ctx.device)
        if hasattr(self.plain, "tie"):
            self.plain.tie()
        self.model = wrap(cpu)
        self.batches = 0
        if optimizers:
            self.make_optimizers()

    def make_optimizers(self):
        import torch_xla
        self.opt = sgd(p for p in self.model.parameters() if p.requires_grad)
        self.plain_opt = sgd(p for p in self.plain.parameters() if p.requires_grad)
        # A step without gradients changes nothing, but registers the optimizer with the
        # wrapper, whose step graphs pin the order of registered optimizers' shards: the
        # first training step then compiles to the same graph as every later one.
        self.opt.step()
        torch_xla.sync()

    def retire(self):
        """Empties both optimizers, so that a scenario's shards stop taking part in later
        scenarios' step graphs (each step pins the donation order of every live optimizer
        that has stepped shards), whenever its reference cycles are collected."""
        for opt in (self.opt, self.plain_opt):
            if opt is not None:
                opt.param_groups.clear()
                opt.state.clear()

    def data(self):
        """(local input, local target, global input, global target) on the device."""
        x, y = batch(self.kind, self.batches)
        self.batches += 1
        n, r, d = GLOBAL_BATCH // WORLD, self.ctx.rank, self.ctx.device
        return x[r * n:(r + 1) * n].to(d), y[r * n:(r + 1) * n].to(d), x.to(d), y.to(d)

    def loss(self, out, target):
        return loss_fn(self.kind, out, target)

    def zero_grad(self):
        self.opt.zero_grad()
        self.plain_opt.zero_grad()

    def opt_step(self):
        self.opt.step()
        self.plain_opt.step()

    def step(self, tag, call=None, after_forward=None, after_backward=None, after_step=None):
        """One ordinary training step of both models."""
        call = call or (lambda m, x: m(x))
        xl, yl, xg, yg = self.data()
        self.zero_grad()
        out = call(self.model, xl)
        if after_forward:
            after_forward()
        loss = self.loss(out, yl)
        loss.backward()
        if after_backward:
            after_backward()
        ref = self.loss(call(self.plain, xg), yg)
        ref.backward()
        self.opt_step()
        if after_step:
            after_step()
        self.finish(tag, loss, ref)

    def finish(self, tag, loss, ref):
        """Ends the step (one sync) and compares the ranks' mean loss with the reference's."""
        import torch_xla
        import torch_xla.core.xla_model as xm
        mean = xm.all_reduce(xm.REDUCE_SUM, loss.detach(), scale=1.0 / WORLD)
        torch_xla.sync()
        got, want = mean.item(), ref.item()
        if not abs(got - want) <= TOL * abs(want):
            self.ctx.problem(f"{tag}: loss {got:.7g}, reference {want:.7g}")

    def compare_params(self, tag):
        full = self.model.full_state_dict(rank0_only=False)
        ref = {k: v.detach().float().cpu() for k, v in self.plain.state_dict().items()}
        names_problem(self.ctx, full, ref)
        compare_values(self.ctx, tag, full, ref)

    def held(self, names=None):
        """Names whose placeholder holds a full parameter (numel() is 1 once freed)."""
        return [n for n in (names or self.names) if placeholder(self.model, n).numel() != 0]

    def check_freed(self, tag, names=None):
        held = self.held(names)
        if held:
            self.ctx.problem(f"{tag}: placeholders still hold full parameters: {_short(held)}")

    def check_no_placeholder_grads(self, tag):
        with_grad = [n for n in self.names if placeholder(self.model, n).grad is not None]
        if with_grad:
            self.ctx.problem(f"{tag}: placeholders hold a .grad: {_short(with_grad)}")


def names_problem(ctx, full, plain_state):
    # no tag: the same mismatch found twice in one scenario is reported once
    if set(full) != set(plain_state):
        ctx.problem(f"full_state_dict names differ from the unwrapped model's state_dict: only "
                    f"in full_state_dict {sorted(set(full) - set(plain_state))}, only in "
                    f"state_dict {sorted(set(plain_state) - set(full))}")


def check_strict_round_trip(ctx, pair, full, build):
    """``full`` (the wrapped model's full state dict) has the unwrapped model's keys and
    loads into it strict, and an unwrapped model's state dict loads into the wrapped one."""
    names_problem(ctx, full, build().state_dict())
    ctx.attempt("plain.load_state_dict(model.full_state_dict(), strict=True)",
                lambda: build().load_state_dict(full, strict=True))
    other = seeded(1, build).state_dict()
    _, loaded = ctx.attempt("model.load_full_state_dict(plain.state_dict())",
                            lambda: pair.model.load_full_state_dict(other))
    if loaded:
        compare_values(ctx, "after load_full_state_dict", pair.model.full_state_dict(False),
                       other)


def compare_values(ctx, tag, got, want):
    bad = []
    for k in sorted(set(got) & set(want)):
        a, b = got[k].float(), want[k].float()
        if a.shape != b.shape:
            bad.append(f"{k} shape {tuple(a.shape)} vs {tuple(b.shape)}")
        else:
            diff = float((a - b).abs().max()) if a.numel() else 0.0
            if not diff <= TOL:
                bad.append(f"{k} max diff {diff:.3g}")
    if bad:
        ctx.problem(f"{tag}: parameters differ from the reference: {_short(bad)}")


def _short(items: List[str]) -> str:
    more = len(items) - _LIST_AT_MOST
    return ", ".join(items[:_LIST_AT_MOST]) + (f" (+{more} more)" if more > 0 else "")


def describe(exc: BaseException) -> str:
    """Type, message and innermost frames: where the wrapper failed."""
    frames = traceback.extract_tb(exc.__traceback__)[-4:]
    where = " <- ".join(f"{_short_path(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
    message = " ".join(str(exc).split())
    if len(message) > 600:
        message = message[:600] + "..."
    return f"{type(exc).__name__}: {message} [at {where}]"


def _short_path(path):
    parts = path.split(os.sep)
    for anchor in ("xla_fsdp", "tests", "torch", "torch_xla"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
    return os.path.basename(path)
