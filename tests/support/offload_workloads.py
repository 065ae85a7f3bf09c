"""What the offload tests run at N ranks: every checkpoint path taken from, and loaded into,
a model whose optimizer lives on the host (``offload_optimizer=True``), against the same
model without offload."""
import filecmp
import os
import re
import threading

import torch

from .checkpoint_workloads import same_snapshot, snapshot, train, tree_differences, wrapped_net

STEPS = range(2)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _same_dcp(a_dir, b_dir):
    """How two DCP directories differ: each rank's data file in bytes, and the metadata's
    entries (file names hold a per-save id)."""
    from torch.distributed.checkpoint import FileSystemReader
    a = sorted(f for f in os.listdir(a_dir) if f.endswith(".distcp"))
    b = sorted(f for f in os.listdir(b_dir) if f.endswith(".distcp"))
    if len(a) != len(b):
        return [f"{a_dir} has {a}, {b_dir} has {b}"]
    found = [f"{x} and {y}" for x, y in zip(a, b, strict=True)
             if not filecmp.cmp(os.path.join(a_dir, x), os.path.join(b_dir, y), shallow=False)]
    meta_a = FileSystemReader(a_dir).read_metadata()
    meta_b = FileSystemReader(b_dir).read_metadata()
    if meta_a.state_dict_metadata != meta_b.state_dict_metadata:
        found.append(".metadata entries")
    return found


_STEPPED = threading.Condition()
_STEPPED.ranks = set()


def _hold_writes():
    """Each rank file's write (on its save's thread) waits until that rank's optimizer has
    stepped: the ranks take turns, so one rank waiting for another would wait for ever."""
    from xla_fsdp.checkpoint.writers import per_rank_files
    with _STEPPED:
        if getattr(per_rank_files._RankFileSave.write, "held", False):
            return
        write = per_rank_files._RankFileSave.write

        def held(self):
            if self.path is not None:
                rank = int(re.search(r"rank-(\d+)-of", self.path).group(1))
                with _STEPPED:
                    if not _STEPPED.wait_for(lambda: rank in _STEPPED.ranks, timeout=120):
                        raise TimeoutError(f"rank {rank}'s optimizer step never came")
            write(self)
        held.held = True
        per_rank_files._RankFileSave.write = held


def checkpoints(rank, root):
    """Returns (problems, where the optimizer state lives) for rank ``rank``."""
    import torch_xla
    import torch_xla.runtime as xr
    from xla_fsdp.checkpoint import (CheckpointManager, load_consolidated, load_dcp,
                                     load_sharded, save_consolidated, save_dcp, save_sharded)
    world = xr.world_size()
    problems = []
    seed = wrapped_net()
    seed_opt = _adamw(seed)
    train(seed, seed_opt, STEPS, rank, world)
    save_sharded(os.path.join(root, "seed", "ckpt"), seed, seed_opt, extra={"step": 2})
    save_dcp(os.path.join(root, "seed_dcp"), seed, seed_opt)
    expected = snapshot(seed, seed_opt)

    # the same checkpoint loaded into the model with and without offload: every save of
    # the two then writes the same bytes
    saved, places = {}, []
    for name, kwargs in (("plain", {}), ("off", {"offload_optimizer": True})):
        model = wrapped_net(**kwargs)
        opt = _adamw(model)
        load_sharded(os.path.join(root, "seed", "ckpt"), model, opt)
        if not same_snapshot(snapshot(model, opt), expected):
            problems.append(f"load_sharded into the {name} model: state differs")
        save_sharded(os.path.join(root, name, "ckpt"), model, opt, extra={"step": 2})
        save_dcp(os.path.join(root, name + "_dcp"), model, opt)
        save_consolidated(os.path.join(root, name + ".pth"), model, opt)
        saved[name] = (model, opt)
    off, off_opt = saved["off"]
    places = sorted({str(p.device) for p in off.parameters()} |
                    {str(v.device) for s in off_opt.state.values() for v in s.values()
                     if torch.is_tensor(v)})
    torch_xla.sync()
    if rank == 0:
        for name in sorted(os.listdir(os.path.join(root, "plain"))):
            a = torch.load(os.path.join(root, "plain", name), weights_only=False)
            b = torch.load(os.path.join(root, "off", name), weights_only=False)
            for tree in (a, b):   # drawn anew by each save
                tree["xla_fsdp"].pop("save_id")
            problems += tree_differences(a, b, f"per-rank {name}")
        problems += [f"dcp: {f}" for f in _same_dcp(os.path.join(root, "plain_dcp"),
                                                    os.path.join(root, "off_dcp"))]
        if not filecmp.cmp(os.path.join(root, "plain.pth"), os.path.join(root, "off.pth"),
                           shallow=False):
            problems.append("consolidated .pth files differ")

    # DCP and the consolidated file, written without offload, load into an offloaded model
    for what, path, load in (("load_dcp", "seed_dcp", load_dcp),
                             ("load_consolidated", "plain.pth", load_consolidated)):
        loaded = wrapped_net(offload_optimizer=True)
        loaded_opt = _adamw(loaded)
        load(os.path.join(root, path), loaded, loaded_opt)
        if not same_snapshot(snapshot(loaded, loaded_opt), expected):
            problems.append(f"{what} into the offloaded model: state differs")

    # an asynchronous save holds the state of its call while the host optimizer steps on:
    # each rank's write waits until its optimizer has stepped in place on what it writes
    train(off, off_opt, range(2, 3), rank, world)   # leaves gradients for one more step
    before = snapshot(off, off_opt)
    _hold_writes()
    pending = save_sharded(os.path.join(root, "async", "ckpt"), off, off_opt, async_save=True)
    off_opt.step()
    with _STEPPED:
        _STEPPED.ranks.add(rank)
        _STEPPED.notify_all()
    pending.wait()
    back = wrapped_net()
    back_opt = _adamw(back)
    load_sharded(os.path.join(root, "async", "ckpt"), back, back_opt)
    if not same_snapshot(snapshot(back, back_opt), before):
        problems.append("async save of the offloaded model: the file is not the state at "
                        "the call")

    # the manager restores into an offloaded model
    manager = CheckpointManager(os.path.join(root, "managed"), format="dcp", async_save=True)
    manager.save(3, off, off_opt, extra={"step": 3})
    manager.wait()
    now = snapshot(off, off_opt)
    restored = wrapped_net(offload_optimizer=True)
    restored_opt = _adamw(restored)
    extra = manager.restore(restored, restored_opt)
    manager.close()
    if extra != {"step": 3} or not same_snapshot(snapshot(restored, restored_opt), now):
        problems.append("CheckpointManager.restore into the offloaded model: state differs")
    return problems, places
