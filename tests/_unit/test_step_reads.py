"""An optimizer step that reads values on the host finds the gradients computed, so forward
and backward run once a step, not once per read ([Note: a host read runs the graph behind it
again] in ``xla_fsdp/_unit/step_reads.py``). One launch at N = 2 watches what is still a
pending graph when the reads happen."""
import torch
import torch.nn as nn

from xla_fsdp import launch
from xla_fsdp._unit.step_reads import _SyncAtFirstRead
from ..support.checks import nonempty

STEPS = 3


class _GuardedSGD(torch.optim.Optimizer):
    """SGD that reads, on the host, whether each gradient is finite before using it (what a
    NaN guard does), noting whether what the gradients are still to compute holds the
    forward and backward (a matmul) at its step's start and after its first read."""

    def __init__(self, params, raise_at_first_step=False):
        super().__init__(params, dict(lr=0.1))
        self.raise_at_first_step = raise_at_first_step
        self.seen, self.seed_kept = [], []

    @torch.no_grad()
    def step(self, closure=None):
        import torch_xla.core.xla_model as xm
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        at_start, seed = _backward_pending(grads), xm.get_rng_state(grads[0].device)
        after_read = None
        for group in self.param_groups:
            for p in group["params"]:
                if not bool(torch.isfinite(p.grad).all()):
                    raise FloatingPointError("a gradient is not finite")
                if after_read is None:
                    after_read = _backward_pending(grads)
                    # the sync does not end the step: the random seed stays
                    self.seed_kept.append(xm.get_rng_state(grads[0].device) == seed)
                    if self.raise_at_first_step and not self.seen:
                        self.seen.append((at_start, after_read))
                        raise KeyError("a step that raised")
                p.add_(p.grad, alpha=-group["lr"])
        self.seen.append((at_start, after_read))


class _Wrapper(torch.optim.Optimizer):
    """An optimizer that steps another, as accelerate's and Lightning's wrappers do."""

    def __init__(self, inner):
        self.inner = inner
        super().__init__(inner.param_groups, {})

    def step(self, closure=None):
        self.inner.step()


class _CountingSGD(torch.optim.SGD):
    """SGD that reads a count of its steps it keeps on the device, as torch's ASGD reads its
    own scalar state: a read that holds no collective, which must not cut the step."""

    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.count, self.pending_at_start = None, []

    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"]]
        self.pending_at_start.append(_backward_pending(grads))
        if self.count is None:
            self.count = torch.zeros((), device=grads[0].device)
        self.count += 1
        assert self.count.item() > 0
        return super().step(closure)


def _backward_pending(grads):
    from xla_fsdp._xla.private_api import graph_hlo
    return " dot(" in graph_hlo(grads)


def _model(dtype=None):
    from xla_fsdp import FSDP
    kw = {"compute_dtype": dtype} if dtype else {}
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Linear(16, 4))
    model[2] = FSDP(model[2], **kw)
    return FSDP(model, **kw)


def steps(rank):
    import torch_xla
    from xla_fsdp._xla.private_api import innermost_function_mode
    device = torch_xla.device()
    torch.manual_seed(0)
    reader, plain, scaled, nested, raising, counting = (
        _model(), _model(), _model(torch.float16), _model(), _model(), _model())
    guarded = _GuardedSGD(reader.parameters())
    adamw = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    sgd = torch.optim.SGD(scaled.parameters(), lr=1e-3)
    counter = _CountingSGD(counting.parameters())
    inner = _GuardedSGD(nested.parameters())
    outer = _Wrapper(inner)
    scaler = torch.amp.GradScaler("xla")
    out = {"plain": [], "scaled": []}
    for opt, key in ((adamw, "plain"), (sgd, "scaled")):
        # the gradients as the step starts, after the global pre-hooks
        opt.register_step_pre_hook(
            lambda o, *_, key=key: out[key].append(
                _backward_pending([p.grad for p in o.param_groups[0]["params"]])))
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device)
        reader(x).pow(2).mean().backward()
        guarded.step()
        plain(x).pow(2).mean().backward()
        adamw.step()
        scaler.scale(scaled(x).float().pow(2).mean()).backward()
        scaler.step(sgd)
        scaler.update()
        nested(x).pow(2).mean().backward()
        outer.step()
        counting(x).pow(2).mean().backward()
        counter.step()
        torch_xla.sync()
        for opt in (guarded, adamw, sgd, inner, counter):
            opt.zero_grad()
    out["guarded"], out["nested"] = guarded.seen, inner.seen
    out["seed_kept"], out["counting"] = guarded.seed_kept, counter.pending_at_start
    # a watched first step that raises leaves its mode on the thread until the next step
    failing = _GuardedSGD(raising.parameters(), raise_at_first_step=True)
    for _ in range(2):
        raising(torch.ones(4, 8).to(device)).sum().backward()
        try:
            failing.step()
        except KeyError:
            out["left_after_raise"] = isinstance(innermost_function_mode(), _SyncAtFirstRead)
    out["failing"] = failing.seen
    out["left_after_next_step"] = isinstance(innermost_function_mode(), _SyncAtFirstRead)
    torch_xla.sync()
    return out


def test_reads_in_a_step_find_the_gradients_computed():
    for rank, out in nonempty(launch(steps, num_devices=2).items(), "ranks"):
        # first step: pending until its first read, which the watching mode synced before;
        # later steps: synced by the step's pre-hook before they start
        assert out["guarded"] == [(True, False)] + [(False, False)] * (STEPS - 1), rank
        assert out["seed_kept"] == [True] * STEPS, rank
        # a step that reads nothing stays one program with its forward and backward, and so
        # does one whose reads hold no collective (its own count)
        assert out["plain"] == [True] * STEPS, rank
        assert out["counting"] == [True] * STEPS, rank
        # GradScaler read its inf flags after one sync
        assert out["scaled"] == [False] * STEPS, rank
        # an optimizer stepped by another's step (torch runs the hooks for both): the outer
        # one's watch covers it
        assert out["nested"] == out["guarded"], rank
        assert out["left_after_raise"] and not out["left_after_next_step"], rank
        # the step after a watched step raised is watched again
        assert out["failing"] == [(True, False), (True, False)], rank
