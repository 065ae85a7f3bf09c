"""What the asynchronous-save and CheckpointManager tests run in one launch."""
import os

from xla_fsdp.checkpoint import CheckpointManager

from .checkpoint_workloads import optimizer_for, same_snapshot, snapshot, train, wrapped_net


def async_and_manager(rank, world, directory):
    import torch_xla.core.xla_model as xm
    from xla_fsdp.checkpoint import (CheckpointManager, PendingSave, load_dcp, load_sharded,
                                     save_dcp, save_sharded)
    out = {}
    model = wrapped_net()
    opt = optimizer_for(model)
    train(model, opt, range(0, 2), rank, world)

    # an asynchronous save holds the state of its call, whatever training does meanwhile
    saved = snapshot(model, opt)
    prefix = os.path.join(directory, "async", "net")
    pending = save_sharded(prefix, model, opt, extra={"step": 2}, async_save=True)
    out["pending_type"] = type(pending) is PendingSave
    dcp_dir = os.path.join(directory, "async_dcp")
    train(model, opt, range(2, 3), rank, world)  # the sharded save is still pending here
    pending_dcp = save_dcp(dcp_dir, model, opt, extra={"step": 3}, async_save=True)
    out["first_published_by_second"] = os.path.exists(
        f"{prefix}_rank-{rank:08d}-of-{world:08d}.pth")
    saved3 = snapshot(model, opt)
    train(model, opt, range(3, 4), rank, world)
    out["dcp_dir"] = pending_dcp.wait()
    out["sharded_extra"] = load_sharded(prefix, model, opt)
    out["sharded_state"] = same_snapshot(snapshot(model, opt), saved)
    out["dcp_extra"] = load_dcp(dcp_dir, model, opt)
    out["dcp_state"] = same_snapshot(snapshot(model, opt), saved3)

    # a manager: DCP, asynchronous, every 2 steps, the last 2 kept; then a new model
    # resumed from it continues exactly as the first one does
    root = os.path.join(directory, "managed")
    manager = CheckpointManager(root, every=2, keep_last=2, format="dcp")
    out["sync_point"] = manager.sync_point_unavailable
    model = wrapped_net()
    opt = optimizer_for(model)
    first = []
    for step in range(10):
        first += train(model, opt, range(step, step + 1), rank, world)
        manager.maybe_save(step + 1, model, opt, extra={"step": step + 1})
    manager.wait()
    out["kept"] = sorted(os.listdir(root))
    out["latest"] = manager.latest()
    at10 = snapshot(model, opt)
    later = train(model, opt, range(10, 13), rank, world)
    manager.close()
    xm.rendezvous("the first model is done")

    resumed = CheckpointManager(root, every=2, keep_last=2, format="dcp")
    model = wrapped_net()
    opt = optimizer_for(model)
    out["restored_extra"] = resumed.restore(model, opt)
    out["restored_state"] = same_snapshot(snapshot(model, opt), at10)
    out["resumed_losses_equal"] = train(model, opt, range(10, 13), rank, world) == later
    out["step8_extra"] = load_dcp(os.path.join(root, "step000008"), model, opt)
    resumed.close()
    out["first_losses"] = len(first)

    # independent sharding groups (each rank a model of its own): each group's files go in
    # the step's directory, from which it restores; nothing is left beside the steps
    groups = dict(sharding_groups=[[r] for r in range(world)], sharding_rank=0,
                  sharding_world_size=1)
    for format in ("dcp", "sharded"):
        root = os.path.join(directory, f"groups_{format}")
        manager = CheckpointManager(root, every=1, keep_last=2, format=format)
        model = wrapped_net(**groups)
        opt = optimizer_for(model)
        for step in range(3):
            train(model, opt, range(step, step + 1), rank, world, split=1)
            manager.maybe_save(step + 1, model, opt, extra={"step": step + 1})
        manager.close()
        at3 = snapshot(model, opt)
        xm.rendezvous(f"groups {format} saved")
        out[f"groups_{format}_kept"] = sorted(os.listdir(root))
        out[f"groups_{format}_step3"] = sorted(os.listdir(os.path.join(root, "step000003")))
        model = wrapped_net(**groups)
        opt = optimizer_for(model)
        out[f"groups_{format}_restored"] = (CheckpointManager(root, on_preemption=False)
                                            .restore(model, opt))
        out[f"groups_{format}_state"] = same_snapshot(snapshot(model, opt), at3)
    out.update(other_runs(rank, world, os.path.join(directory, "runs")))
    return out


def other_runs(rank, world, root):
    """[Note: one run per directory]: a run that did not restore, or restored an earlier
    step, is refused where it would save beside another run's checkpoints; nothing changes
    on disk. A manager's own step is not written again; a given step restores."""
    import torch_xla.core.xla_model as xm
    from xla_fsdp.checkpoint import CheckpointError
    out = {}
    model = wrapped_net()
    opt = optimizer_for(model)
    first = CheckpointManager(root, every=1, async_save=False, on_preemption=False)
    for step in range(3):
        train(model, opt, range(step, step + 1), rank, world)
        first.maybe_save(step + 1, model, opt, extra={"run": 1, "step": step + 1})
    first.close()
    xm.rendezvous("the first run saved")

    def listing():
        return {name: sorted(os.listdir(os.path.join(root, name)))
                for name in sorted(os.listdir(root)) if name.startswith("step")}

    def stamps():
        return {name: os.stat(os.path.join(root, name, "COMPLETE")).st_mtime_ns
                for name in sorted(os.listdir(root)) if name.startswith("step")}

    before, saved = listing(), stamps()
    for case, restore_step, save_step in (("fresh", None, 1), ("fresh_later", None, 3),
                                          ("rolled_back", 2, 3), ("rolled_back_later", 1, 9)):
        manager = CheckpointManager(root, every=1, async_save=False, on_preemption=False)
        model = wrapped_net()
        opt = optimizer_for(model)
        if restore_step is not None:
            out[f"{case}_restored"] = manager.restore(model, opt, step=restore_step)
        train(model, opt, range(40, 41), rank, world)
        try:
            manager.maybe_save(save_step, model, opt, extra={"run": case})
            out[case] = "saved"
        except CheckpointError as exc:
            out[case] = str(exc)
        manager.close()
        xm.rendezvous(f"{case} done")
    out["unchanged"] = listing() == before and stamps() == saved

    # a rank whose filesystem never shows step 3: refused on every rank, after waiting
    lagging = CheckpointManager(root, every=1, async_save=False, on_preemption=False)
    if rank == 1:
        shown = lagging.directory.is_complete
        lagging.directory.is_complete = lambda step: step != 3 and shown(step)
    try:
        lagging.restore(wrapped_net(), None)
        out["lagging_restored"] = lagging.restored_step
    except CheckpointError as exc:
        out["lagging_restored"] = str(exc)
    lagging.close()
    empty = CheckpointManager(os.path.join(root, "empty"), on_preemption=False)
    out["missing_ok"] = (empty.restore(wrapped_net(), None, missing_ok=True),
                         empty.restored_step)
    empty.close()

    manager = CheckpointManager(root, every=1, async_save=False, on_preemption=False)
    model = wrapped_net()
    opt = optimizer_for(model)
    out["latest_restored"] = manager.restore(model, opt)
    out["own_step_again"] = manager.maybe_save(3, model, opt, extra={"run": "again"})
    out["older_step"] = manager.save(2, model, opt, extra={"run": "older"})
    out["own_unchanged"] = stamps() == saved
    try:
        manager.restore(model, opt, step=7)
        out["missing_step"] = "restored"
    except CheckpointError as exc:
        out["missing_step"] = str(exc)
    out["continued"] = manager.maybe_save(4, model, opt, extra={"run": 1, "step": 4})
    out["rolled_back_in_process"] = (manager.restore(model, opt, step=2),
                                     manager.restored_step == 2)
    try:
        manager.maybe_save(3, model, opt, extra={"run": "rolled back"})
        out["after_rollback"] = "saved"
    except CheckpointError as exc:
        out["after_rollback"] = str(exc)
    manager.close()
    return out


def unwaited_async_save(rank, directory):
    """Starts an asynchronous save and returns without waiting for it; and one inside a
    manager's ``with`` block, which publishes it at its end."""
    import torch
    from xla_fsdp import FSDP
    from xla_fsdp.checkpoint import save_sharded
    model = FSDP(torch.nn.Linear(4, 4))
    with CheckpointManager(os.path.join(directory, "managed"), on_preemption=False) as manager:
        manager.save(3, model)
    save_sharded(os.path.join(directory, "net"), model, async_save=True)
