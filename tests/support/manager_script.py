"""A training process with a ``CheckpointManager``, for the tests that signal or kill it:

    python -m tests.support.manager_script DIR --steps 12 --every 2 [--format dcp]
        [--devices 2] [--stall-at S]

It resumes from DIR's latest checkpoint if there is one, trains ``wrapped_net`` to
``--steps``, and appends each step's global loss to DIR/losses.txt as ``step loss.hex()``
(exact) once the step is done. With ``--stall-at S`` the background write of step S's save
writes its file and then sleeps, after creating DIR/stalled: a write in flight, for a test
to kill. It exits with ``PREEMPTED_EXIT_CODE`` when stopped by a preemption. With ``--no-manager``
its ranks only wait, watched by no manager.
"""
import argparse
import os
import sys
import threading
import time


def run(rank, args):
    from xla_fsdp.checkpoint import CheckpointManager

    from .checkpoint_workloads import optimizer_for, train, wrapped_net

    world = args.devices
    model = wrapped_net()
    opt = optimizer_for(model)
    manager = CheckpointManager(os.path.join(args.dir, "ckpt"), every=args.every,
                                keep_last=args.keep_last, format=args.format)
    start = 0
    if manager.latest() is not None:
        manager.restore(model, opt)
        start = manager.latest()
    for step in range(start, args.steps):
        (value,) = train(model, opt, range(step, step + 1), rank, world)
        if rank == 0:
            with open(os.path.join(args.dir, "losses.txt"), "a") as f:
                f.write(f"{step} {value.hex()}\n")
        if args.pause:
            time.sleep(args.pause)
        manager.maybe_save(step + 1, model, opt)
        if manager.stop_requested:
            sys.exit(_exit_code())
    manager.close()
    return manager.latest()


def _exit_code():
    from xla_fsdp.checkpoint import PREEMPTED_EXIT_CODE
    return PREEMPTED_EXIT_CODE


def _stall_writes_at(step, directory):
    """Makes the background write of ``step``'s save stall once its bytes are written."""
    import torch
    name = f"step{step:06d}"
    original = torch.save

    def save(obj, f, *args, **kwargs):
        original(obj, f, *args, **kwargs)
        path = getattr(f, "name", f)
        if (name in str(path) and threading.current_thread() is not threading.main_thread()
                and threading.current_thread().name.startswith("xla_fsdp save")):
            open(os.path.join(directory, "stalled"), "w").close()
            time.sleep(600)

    torch.save = save


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--format", default="sharded")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--stall-at", type=int, default=None)
    p.add_argument("--pause", type=float, default=0.0, help="seconds after each step")
    p.add_argument("--no-manager", action="store_true",
                   help="only wait (DIR/waiting once the ranks run), with no manager")
    args = p.parse_args(argv)
    from xla_fsdp import launch
    launch(_run, (args,), num_devices=args.devices)


def _run(rank, args):
    if args.no_manager:
        open(os.path.join(args.dir, "waiting"), "w").close()
        time.sleep(300)
        return None
    if args.stall_at is not None and rank == 0:  # torch.save is the process's, every rank's
        _stall_writes_at(args.stall_at, args.dir)
    return run(rank, args)


if __name__ == "__main__":
    main()
