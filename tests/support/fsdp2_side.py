"""The other side of the DCP tests: PyTorch's own FSDP2 (``fully_shard`` on a CPU device mesh,
gloo, M processes), run as a user of it would, with nothing of ours and no torch_xla.

    python -m tests.support.fsdp2_side continue DIR START STEPS OUT.json [M]
        loads DIR with the standard recipe, then trains STEPS steps from step START
    python -m tests.support.fsdp2_side train_save DIR STEPS_BEFORE STEPS_AFTER OUT.json [M]
        trains from the seeded initial model, saves DIR with dcp.save, trains on

OUT.json gets every step's loss (the mean over the global batch) and which of torch_xla and
xla_fsdp any process imported (none may). The model, data and optimizer are the suite's
(``models.Net``, ``models.batch``, AdamW as the parity settings build it).
"""
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .models import GLOBAL_BATCH, Net, batch, loss_fn

LR, WEIGHT_DECAY = 1e-3, 0.01


def _build():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Net()
    fully_shard(model.b1, mesh=mesh)
    fully_shard(model.b2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def _train(model, opt, start, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = GLOBAL_BATCH // world
    losses = []
    for step in range(start, start + steps):
        x, y = batch("net", step)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        opt.zero_grad()
        loss = loss_fn("net", model(x), y)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _worker(rank, world, port, mode, args, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    model, opt = _build()
    directory = args[0]
    if mode == "continue":
        start, steps = int(args[1]), int(args[2])
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        losses = _train(model, opt, start, steps)
    else:
        before, after = int(args[1]), int(args[2])
        losses = _train(model, opt, 0, before)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=directory)
        losses += _train(model, opt, before, after)
    imported = [None] * world
    dist.all_gather_object(imported, [m for m in ("torch_xla", "xla_fsdp") if m in sys.modules])
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "imported": sorted(set(sum(imported, [])))}, f)
    dist.destroy_process_group()


def main(argv):
    mode, rest = argv[0], argv[1:]
    world = int(rest[4]) if len(rest) > 4 else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, mode, rest[:3], rest[3]), nprocs=world, join=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
