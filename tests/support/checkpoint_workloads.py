"""The model and training loop the checkpoint tests save, consolidate, reshard and resume."""
import torch

from .models import GLOBAL_BATCH, Net, batch, loss_fn

LR, MOMENTUM = 0.1, 0.9


def wrapped_net(**kwargs):
    """Net with three sharding modes at once: a flattened unit, a dim-0 unit, a plain root."""
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    model = Net()
    model.b1 = FSDP(model.b1, flatten_parameters=True, **kwargs)
    model.b2 = FSDP(model.b2, shard_param_on_dim_0=True, **kwargs)
    return FSDP(model, **kwargs)


def optimizer_for(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def train(model, opt, steps, rank, world):
    """SGD steps on the rank's slice of each global batch; returns the global losses."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    device = torch_xla.device()
    losses = []
    local = GLOBAL_BATCH // world
    for step in steps:
        x, y = batch("net", step)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        opt.zero_grad()
        loss = loss_fn("net", model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        if world > 1:
            loss = xm.all_reduce(xm.REDUCE_SUM, loss.detach(), scale=1.0 / world)
        torch_xla.sync()
        losses.append(loss.item())
    return losses
