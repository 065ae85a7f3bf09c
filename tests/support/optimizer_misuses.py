"""Misuses of an optimizer over FSDP shards, for ``tests/fully_sharded/test_bad_input.py``'s
one launch: state loaded of another shape, a unit frozen or clipped mid-accumulation, weight
decay split by shard shape, a parameter in no unit."""
import torch
import torch.nn as nn

from .checks import every, nonempty, pairs


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def error_of(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def full_optimizer_state(out):
    """A full optimizer state (of whole parameters) loaded with ``load_state_dict`` into an
    optimizer that stepped already: refused at its next step, before any update."""
    import torch_xla
    from xla_fsdp import FSDP
    model = FSDP(Tiny())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4).to(torch_xla.device())).sum().backward()
    opt.step()
    state = opt.state_dict()
    for index in nonempty(state["state"], "optimizer states"):
        state["state"][index]["momentum_buffer"] = torch.zeros(4, 4)
    opt.load_state_dict(state)
    before = [p.detach().cpu().clone() for p in model.parameters()]
    # a unit frozen between micro-batches of a no_sync accumulation
    inner = FSDP(Tiny())
    outer = FSDP(nn.Sequential(inner, Tiny()))
    outer_opt = torch.optim.SGD(outer.parameters(), lr=0.1)
    with outer.no_sync():
        outer(torch.ones(2, 4).to(torch_xla.device())).sum().backward()
    inner.requires_grad_(False)
    outer(torch.ones(2, 4).to(torch_xla.device())).sum().backward()
    out["frozen_mid_accumulation"] = error_of(outer_opt.step)
    # clipped between micro-batches: the shards hold nothing reduced yet
    clipped = FSDP(nn.Sequential(FSDP(Tiny()), Tiny()))
    with clipped.no_sync():
        clipped(torch.ones(2, 4).to(torch_xla.device())).sum().backward()
    out["clip_mid_accumulation"] = [error_of(lambda: clipped.clip_grad_norm_(1.0))]
    clipped(torch.ones(2, 4).to(torch_xla.device())).sum().backward()
    out["clip_mid_accumulation"].append(error_of(lambda: clipped.clip_grad_norm_(1.0)))
    torch_xla.sync()
    # weight decay split by p.dim() (nanoGPT's recipe) over flat shards
    split = FSDP(Tiny())
    shards = list(split.parameters())
    split_opt = torch.optim.AdamW([
        {"params": [p for p in shards if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in shards if p.dim() < 2], "weight_decay": 0.0}])
    split(torch.ones(2, 4).to(torch_xla.device())).sum().backward()
    out["decay_by_dim"] = error_of(split_opt.step)
    out["full_optimizer_state"] = (error_of(opt.step), every(
        torch.equal(a, p.detach().cpu()) for a, p in pairs(before, model.parameters())))
    # a parameter in no unit, stepped beside the shards: refused unless its gradient is
    # all-reduced before the step
    import torch_xla.core.xla_model as xm
    free = []
    for reduce in (False, True):
        temperature = nn.Parameter(torch.ones(1, device=torch_xla.device()))
        scaled = FSDP(Tiny())
        free_opt = torch.optim.SGD(list(scaled.parameters()) + [temperature], lr=0.1)
        (scaled(torch.ones(2, 4).to(torch_xla.device())) * temperature).sum().backward()
        if reduce:
            xm.all_reduce(xm.REDUCE_SUM, [temperature.grad], scale=0.5)
        free.append(error_of(free_opt.step))
        torch_xla.sync()
    out["free_parameter"] = free
    # a state of another layout's shards (3 elements, not the shard's), or of one element,
    # which is no scalar (the rule every checkpoint applies too: _sharding.state_layout)
    out["other_layout_state"] = []
    for elements in 3, 1:
        for index in state["state"]:
            state["state"][index]["momentum_buffer"] = torch.zeros(elements)
        opt.load_state_dict(state)
        out["other_layout_state"].append(error_of(opt.step))
        torch_xla.sync()
    # but scalars an optimizer keeps as one-element or empty tensors train on (a (1,) step:
    # older torch's capturable Adam, Sophia; torch_xla's syncfree Adam's empty max_exp_avg_sq)
    shards = list(model.parameters())
    for index in state["state"]:
        state["state"][index].update(momentum_buffer=torch.zeros(shards[index].shape),
                                     step=torch.zeros(1), max_exp_avg_sq=torch.zeros(0))
    opt.load_state_dict(state)
    out["own_scalars"] = error_of(opt.step)
    torch_xla.sync()
