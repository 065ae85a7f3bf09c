"""A script written for torch_xla, as ``python -m xla_fsdp.launch`` runs it unchanged: it
imports torch_xla's FSDP at its top and starts its ranks with ``xmp.spawn`` (``spawn N``)
or ``torch_xla.launch`` (``launch``). Each rank prints its world, which FSDP wrapped it,
and its loss after two SGD steps on its slice of one batch."""
import sys

import torch
import torch_xla.distributed.xla_multiprocessing as xmp
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP


def _mp_fn(index, lr):
    import torch_xla
    import torch_xla.runtime as xr
    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                     torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    world, rank = xr.world_size(), xr.global_ordinal()
    x = torch.linspace(-1, 1, 32).reshape(8, 4)
    y = x.sum(1, keepdim=True)
    n = 8 // world
    for _ in range(2):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(
            model(x[rank * n:(rank + 1) * n].to(torch_xla.device())),
            y[rank * n:(rank + 1) * n].to(torch_xla.device()))
        loss.backward()
        opt.step()
        torch_xla.sync()
    print(f"rank {rank} of {world} ({index}): {type(model).__module__} {loss.item():.6f}",
          flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "launch":
        import torch_xla
        torch_xla.launch(_mp_fn, args=("from torch_xla.launch", 0.1))
    else:
        xmp.spawn(_mp_fn, args=(0.1,), nprocs=int(sys.argv[2]))
