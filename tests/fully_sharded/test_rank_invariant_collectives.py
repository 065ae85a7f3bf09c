"""With ``zero_missing_gradients``, ranks whose data leave some parameters without a
gradient still issue the same collectives (on hardware, different collectives hang every
rank); without it, such a group is not reduced (as a module every rank skipped).

The step graphs of such ranks differ in their compute, which virtual devices cannot run
together, so the graphs are only traced: each rank returns the sequence of collectives in
its step's HLO and nothing is executed.
"""
import torch
import torch.nn as nn

from xla_fsdp import launch

from ..support.hlo import collectives, traced_hlo

DIM = 8


class Experts(nn.Module):
    """Data-dependent routing: an expert no token of this rank chose is not run at all."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, 2)
        self.experts = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])

    def forward(self, x, used):
        weight = self.gate(x).softmax(-1)
        out = x
        for i, expert in enumerate(self.experts):
            if i in used:  # a Python decision, as after reading the routing on the host
                out = out + weight[:, i:i + 1] * expert(x)
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = Experts()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x, used):
        return self.head(self.moe(self.inp(x), used))


def _trace(rank, zero_missing):
    import torch_xla
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    model = Net()
    model.moe = FSDP(model.moe, zero_missing_gradients=zero_missing)
    model = FSDP(model, zero_missing_gradients=zero_missing)
    x = torch.randn(4, DIM).to(torch_xla.device())
    # rank 0's tokens all chose expert 0, rank 1's both experts
    model(x, (0,) if rank == 0 else (0, 1)).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    out = {"step": collectives(traced_hlo(grads)), "grads": len(grads)}
    # a rank whose loss did not reach any parameter still joins the norm's reduction
    for p in model.parameters():
        p.grad = None if rank == 1 else p.grad
    out["clip"] = collectives(traced_hlo([model.clip_grad_norm_(1.0)]))
    return out


def test_ranks_issue_the_same_collectives_whatever_their_data_reaches():
    results = launch(_trace, (True,), num_devices=2)
    assert results[0]["grads"] == results[1]["grads"] == len(list(Net().parameters()))
    assert results[0]["step"] == results[1]["step"]
    assert any("reduce-scatter" in c for c in results[0]["step"])
    assert results[0]["clip"] == results[1]["clip"] != []


def test_without_the_option_a_skipped_expert_is_not_reduced():
    results = launch(_trace, (False,), num_devices=2)
    assert results[1]["grads"] == len(list(Net().parameters()))
    assert results[0]["grads"] == results[1]["grads"] - 2  # expert 1's weight and bias
