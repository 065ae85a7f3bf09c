"""The other side of the DCP tests: PyTorch's own FSDP2 (``fully_shard`` on a CPU device mesh,
gloo, M processes), run as a user of it would, with nothing of ours and no torch_xla.

    python -m tests.support.fsdp2_side continue START STEPS OUT.json M RECIPE=DIR ...
        for each DIR: a fresh model loads it with RECIPE, then trains STEPS steps from START
    python -m tests.support.fsdp2_side train_save BEFORE AFTER OUT.json M RECIPE=DIR ...
        trains BEFORE steps from the seeded initial model, saves each DIR with its RECIPE,
        trains AFTER steps more

A RECIPE is how the state is put to DCP and taken back:
    get_state_dict  the standard one: {"model": msd, "optimizer": osd} of get_state_dict,
                    dcp.save / dcp.load, set_state_dict
    torchtitan      torchtitan's checkpointer: the model's entries at the top level, the
                    optimizer flattened (flatten_optimizer_state_dict) under "optimizer", its
                    own train_state and lr_scheduler beside (saved, not loaded: what
                    --checkpoint.exclude_from_loading leaves out)

OUT.json gets every step's loss (the mean over the global batch; for ``continue``, per
directory) and which of torch_xla and xla_fsdp any process imported (none may). The model,
data and optimizer are the suite's (``models.Net``, ``models.batch``, AdamW as the parity
settings build it).
"""
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
# imported before any process group exists: torch.distributed.fsdp imports
# torch.distributed.nn.functional, whose functions take ``group=group.WORLD`` as a default
# evaluated at import; imported after init_process_group, ten of them held the gloo group,
# which destroy_process_group then never freed, and its threads ran on into interpreter exit
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from .checks import every
from .models import GLOBAL_BATCH, Net, batch, loss_fn

LR, WEIGHT_DECAY = 1e-3, 0.01


def _build():
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


def _save(recipe, model, opt, directory, step):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, get_state_dict)
    if recipe == "get_state_dict":
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=directory)
        return
    state = dict(get_model_state_dict(model))
    state["optimizer"] = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state["train_state"] = {"step": torch.tensor(step, dtype=torch.int32)}
    state["lr_scheduler"] = {"last_epoch": step}
    dcp.save(state, checkpoint_id=directory)


def _load(recipe, model, opt, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict,
        set_model_state_dict, set_optimizer_state_dict, set_state_dict)
    if recipe == "get_state_dict":
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        return
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    msd = get_model_state_dict(model)
    state = dict(msd, optimizer=get_optimizer_state_dict(model, opt, options=flat))
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, {k: state[k] for k in msd})
    set_optimizer_state_dict(model, opt, state["optimizer"], options=flat)


def _worker(rank, world, store, mode, a, b, targets, out):
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}")
    if mode == "continue":
        losses = {}
        for recipe, directory in targets:
            model, opt = _build()
            _load(recipe, model, opt, directory)
            losses[directory] = _train(model, opt, a, b)
    else:
        model, opt = _build()
        losses = _train(model, opt, 0, a)
        for recipe, directory in targets:
            _save(recipe, model, opt, directory, a)
        losses += _train(model, opt, a, b)
    imported = [None] * world
    dist.all_gather_object(imported, [m for m in ("torch_xla", "xla_fsdp") if m in sys.modules])
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "imported": sorted(set(sum(imported, [])))}, f)
    # FSDP2's state (reference cycles) holds the group too: collected here, the group's last
    # reference goes with destroy_process_group, which so joins gloo's threads before exit
    del model, opt
    gc.collect()
    dist.barrier()   # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


def main(argv):
    mode, a, b, out, world = argv[0], int(argv[1]), int(argv[2]), argv[3], int(argv[4])
    targets = [tuple(t.split("=", 1)) for t in argv[5:]]
    assert every(r in ("get_state_dict", "torchtitan") for r, _ in targets), targets
    # the ranks meet through a file beside the output, not a free port picked here and
    # released: a test running beside this one could take that port before rank 0 binds it
    store = out + ".rendezvous"
    if os.path.exists(store):
        os.remove(store)
    mp.spawn(_worker, args=(world, store, mode, a, b, targets, out), nprocs=world, join=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
