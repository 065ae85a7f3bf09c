"""A disk that fills up mid-save, for every writer: per-rank files, DCP, and the consolidated
.pth / .safetensors / DCP / resharded outputs. Each must raise a CheckpointError naming the
file, the space it needed and what was free; leave the previous checkpoint loadable; and
leave no file of the failed save anywhere (the filesystem's free space is back to what it
was, so no temporary file is left open either).

The disks are real: small tmpfs mounts the test makes, filled with a ballast file to leave
a chosen amount free, so torch, DCP and Python fail as they would on a full disk (ENOSPC,
and torch's "unexpected pos" from its zip writer). One N=4 launch holds every XLA check;
the consolidation checks run in this process (an abort in torch's writer would end it).
"""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from xla_fsdp import launch
from xla_fsdp.checkpoint.consolidate import main as consolidate_main

from ..support.checkpoint_workloads import frames_keeping, optimizer_for, train, wrapped_net
from ..support.checks import every, nonempty

WORLD, FULL_RANK = 4, 2
PAGE = 4096


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    """``make(name, size)``: a directory on a tmpfs of ``size`` bytes, unmounted afterwards."""
    mounted = []

    def make(name, size):
        path = tmp_path_factory.mktemp(name)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(path)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"needs a small filesystem of its own; mount -t tmpfs was refused: "
                        f"{done.stderr.strip()}")
        mounted.append(path)
        return str(path)

    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture(scope="module")
def launched(small_disk, tmp_path_factory):
    own_disks = [small_disk(f"host{r}", 2 << 20) for r in range(WORLD)]
    shared = small_disk("shared", 4 << 20)
    prefix = str(tmp_path_factory.mktemp("plain") / "net")
    out = launch(at_four, (own_disks, shared, prefix), num_devices=WORLD)
    return {"own_disks": own_disks, "shared": shared, "prefix": prefix, "out": out}


def free(disk):
    stat = os.statvfs(disk)
    return stat.f_bavail * stat.f_frsize


def empty_ballast(disk):
    path = os.path.join(disk, "ballast")
    if os.path.exists(path):
        os.remove(path)
    return path


def leave_free(disk, nbytes):
    """Fills ``disk`` with a ballast file until ``nbytes`` (rounded down to a page) are free."""
    path = empty_ballast(disk)
    size = free(disk) - nbytes
    if size > 0:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        try:
            os.posix_fallocate(fd, 0, size // PAGE * PAGE + (PAGE if size % PAGE else 0))
        finally:
            os.close(fd)


def state(disk):
    """Every file on ``disk`` (hidden ones too) with its bytes, and the free space."""
    files = {}
    for root, _, names in os.walk(disk):
        for name in names:
            if name != "ballast":
                with open(os.path.join(root, name), "rb") as f:
                    files[os.path.relpath(os.path.join(root, name), disk)] = f.read()
    return files, free(disk)


def size_of(directory, start=""):
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
               if n.startswith(start) and n != "ballast")


def _attempt(save, *args, **kwargs):
    from xla_fsdp.checkpoint import CheckpointError
    try:
        save(*args, **kwargs)
    except CheckpointError as exc:
        # a frame that still names the exception keeps the model and optimizer alive on
        # this rank alone
        assert not frames_keeping(exc), (save.__name__, frames_keeping(exc))
        return str(exc)
    return None


def _same_full_state(model, saved):
    full = model.full_state_dict(rank0_only=False)
    return sorted(full) == sorted(saved) and every(torch.equal(full[k], v)
                                                   for k, v in saved.items())


def at_four(rank, own_disks, shared, plain_prefix):
    """Saves that fit, then the same saves on a disk too full for them, then loads.
    ``plain_prefix``: checkpoints on an ordinary disk, of two states, for the consolidation
    test."""
    import torch_xla.core.xla_model as xm
    from xla_fsdp.checkpoint import (CheckpointManager, load_consolidated, load_dcp,
                                     load_sharded, save_consolidated, save_dcp, save_sharded)
    model = wrapped_net()
    opt = optimizer_for(model)
    train(model, opt, range(0, 2), rank, WORLD)
    own = os.path.join(own_disks[rank], "net")  # one disk per host; the one of FULL_RANK fills
    step2, step3 = os.path.join(shared, "step2"), os.path.join(shared, "step3")
    dcp_dir = os.path.join(shared, "dcp")
    save_sharded(own, model, opt, extra={"step": 2})
    save_sharded(step2, model, opt, extra={"step": 2})
    save_dcp(dcp_dir, model, opt, extra={"step": 2})
    save_sharded(plain_prefix, model, opt, extra={"step": 2})
    # consolidated from training code: rank 0 writes it on its own host's disk
    consolidated = os.path.join(own_disks[rank], "consolidated.pth")
    save_consolidated(consolidated, model, opt, extra={"step": 2})
    saved = model.full_state_dict(rank0_only=False)  # every rank checks its loads
    train(model, opt, range(2, 3), rank, WORLD)  # a state unlike the saved one, to save next
    save_sharded(plain_prefix + "_later", model, opt, extra={"step": 3})
    out = {}

    # the same prefix again, with FULL_RANK's disk too full for its file
    if rank == FULL_RANK:
        leave_free(own_disks[rank], size_of(own_disks[rank]) // 2)
    xm.rendezvous("own disk filled")
    before = state(own_disks[rank])
    out["own_error"] = _attempt(save_sharded, own, model, opt, extra={"step": 3})
    out["own_unchanged"] = state(own_disks[rank]) == before
    xm.rendezvous("own checked")  # before the disk is filled anew

    # a new prefix on the shared disk (the example's --checkpoint-every): room for 1.5 files
    if rank == 0:
        leave_free(shared, size_of(shared, "step2") * 3 // (2 * WORLD))
    xm.rendezvous("shared disk filled")
    before = state(shared)
    xm.rendezvous("looked")  # before any rank starts writing there
    out["step3_error"] = _attempt(save_sharded, step3, model, opt, extra={"step": 3})
    out["step3_unchanged"] = state(shared) == before
    xm.rendezvous("step3 checked")  # before the disk is filled anew

    # DCP over the previous save, with room for half of it
    if rank == 0:
        leave_free(shared, size_of(dcp_dir) // 2)
    xm.rendezvous("shared disk filled again")
    before = state(shared)
    xm.rendezvous("looked again")
    out["dcp_error"] = _attempt(save_dcp, dcp_dir, model, opt, extra={"step": 3})
    out["dcp_unchanged"] = state(shared) == before
    xm.rendezvous("dcp checked")  # before the disk is filled anew

    # save_consolidated over the previous one, host 0's disk with room for half of it
    if rank == 0:
        leave_free(own_disks[0], os.path.getsize(consolidated) // 2)
    xm.rendezvous("host 0 filled")
    before = state(own_disks[rank])
    out["consolidated_error"] = _attempt(save_consolidated, consolidated, model, opt,
                                         extra={"step": 3})
    out["consolidated_unchanged"] = state(own_disks[rank]) == before

    # asynchronous: the save returns, training goes on, the error comes at wait() (and at
    # a manager's next call), and nothing is published
    if rank == FULL_RANK:
        leave_free(own_disks[rank], size_of(own_disks[rank]) // 2)
    xm.rendezvous("own disk filled for the asynchronous saves")
    before = state(own_disks[rank])
    pending = save_sharded(own, model, opt, extra={"step": 3}, async_save=True)
    train(model, opt, range(5, 6), rank, WORLD)
    out["async_error"] = _attempt(pending.wait)
    out["async_unchanged"] = state(own_disks[rank]) == before
    manager = CheckpointManager(os.path.join(own_disks[rank], "managed"), every=1)
    manager.save(1, model, opt)
    train(model, opt, range(6, 7), rank, WORLD)
    out["manager_error"] = _attempt(manager.wait)
    out["manager_latest"] = manager.latest()
    xm.rendezvous("asynchronous saves checked")

    # every previous checkpoint loads, and holds what was saved
    out["own_extra"] = load_sharded(own, model, opt)
    out["own_loads"] = _same_full_state(model, saved)
    out["step2_extra"] = load_sharded(step2, model, opt)
    out["step2_loads"] = _same_full_state(model, saved)
    train(model, opt, range(3, 4), rank, WORLD)
    out["dcp_extra"] = load_dcp(dcp_dir, model, opt)
    out["dcp_loads"] = _same_full_state(model, saved)
    train(model, opt, range(4, 5), rank, WORLD)
    # only host 0 has it: rank 0 reads, the others receive over the collectives
    out["consolidated_extra"] = load_consolidated(consolidated, model, opt,
                                                  first_rank_reads=True)
    out["consolidated_loads"] = _same_full_state(model, saved)
    return out


def _names_the_full_disk(message, path):
    """The failing rank's own error: the file by its final name, what it needed, what was free."""
    return (message.startswith(f"{path}: not written: no space left on the device")
            and ("needs at least" in message or "a write of" in message)
            and "bytes free" in message
            and "No space left on device" in message)


def test_saves_on_a_full_disk(launched):
    own_disks, shared, out = launched["own_disks"], launched["shared"], launched["out"]

    for rank, result in nonempty(out.items(), "ranks"):
        # per-rank files, the same prefix: FULL_RANK's disk is full, every rank raises
        path = os.path.join(own_disks[rank], f"net_rank-{rank:08d}-of-{WORLD:08d}.pth")
        if rank == FULL_RANK:
            assert _names_the_full_disk(result["own_error"], path), result["own_error"]
        else:
            assert result["own_error"].startswith(f"rank {FULL_RANK} failed, so this rank "
                                                  f"stopped too: CheckpointError: "), rank
        assert result["own_unchanged"], rank  # the old file, byte for byte; no temporary one
        assert result["own_extra"] == {"step": 2} and result["own_loads"], rank
        # a new prefix on a shared disk: no rank keeps a file of it
        assert result["step3_unchanged"] and result["step2_extra"] == {"step": 2}
        assert result["step2_loads"], rank
        # DCP over the previous save: .metadata and the data files as they were
        assert result["dcp_unchanged"] and result["dcp_extra"] == {"step": 2}
        assert result["dcp_loads"], rank
        # save_consolidated on host 0's full disk: the previous file stays and loads
        if rank == 0:
            path = os.path.join(own_disks[0], "consolidated.pth")
            assert _names_the_full_disk(result["consolidated_error"], path), \
                result["consolidated_error"]
        else:
            assert result["consolidated_error"].startswith("rank 0 failed, so this rank "
                                                           "stopped too: "), rank
        assert result["consolidated_unchanged"], rank
        assert result["consolidated_extra"] == {"step": 2}
        assert result["consolidated_loads"], rank
        # asynchronous: the error at wait(), naming the file; nothing published
        for key in ("async_error", "manager_error"):
            if rank == FULL_RANK:
                assert ": not written: no space left on the device" in result[key], result[key]
            else:
                assert result[key].startswith(f"rank {FULL_RANK} failed, so this rank "), rank
        path = os.path.join(own_disks[rank], f"net_rank-{rank:08d}-of-{WORLD:08d}.pth")
        if rank == FULL_RANK:
            assert result["async_error"].startswith(f"{path}: not written"), result["async_error"]
        assert result["async_unchanged"], rank
        assert result["manager_latest"] is None, rank

    for key, file_pattern in (("step3_error", "step3_rank-{rank:08d}-of-00000004.pth"),
                              ("dcp_error", None)):
        own = {r: res[key] for r, res in out.items() if not res[key].startswith("rank ")}
        assert own, f"{key}: no rank reported the full disk itself"
        for rank, message in nonempty(own.items(), "ranks that named the full disk"):
            if file_pattern:
                path = os.path.join(shared, file_pattern.format(rank=rank))
            else:
                path = message.split(": not written", 1)[0]
                assert os.path.dirname(path) == os.path.join(shared, "dcp")
                assert path.endswith(".distcp") and f"__{rank}_" in path, path
            assert _names_the_full_disk(message, path), message
        for rank, result in nonempty(out.items(), "ranks"):
            assert result[key] is not None, (key, rank)


def _consolidate(*args):
    return consolidate_main(list(args))


def _fails_on_full_disk(capsys, disk, path, args, room):
    """Runs the tool over its previous output, with ``room`` bytes free; it must fail with the
    file named (``path``, or any when None) and leave the disk as it was. Returns the error."""
    leave_free(disk, room)
    before = state(disk)
    assert _consolidate(*args) == 2
    err = capsys.readouterr().err
    message = err.split("consolidate_sharded_ckpts: error: ", 1)[1]
    assert _names_the_full_disk(message, path or message.split(": not written", 1)[0]), err
    assert state(disk) == before  # the previous output byte for byte, nothing else
    return message


def _pages(directory, names):
    return sum(-(-os.path.getsize(os.path.join(directory, n)) // PAGE) * PAGE for n in names)


def test_consolidation_on_a_full_disk(launched, small_disk, tmp_path, capsys):
    """Each output is written from the step-2 checkpoint, then over it from the step-3 one on
    a disk too full for that, which must leave the step-2 output as it was."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    first, later = launched["prefix"], launched["prefix"] + "_later"
    disk = small_disk("out", 4 << 20)

    def run(source, fmt, out, *more):
        return ("--ckpt_prefix", source, "--format", fmt, "--save_path", out, *more)

    def write_first(fmt, out, *more):
        empty_ballast(disk)
        assert _consolidate(*run(first, fmt, out, *more)) == 0

    out = os.path.join(disk, "net.pth")
    write_first("pt", out)
    _fails_on_full_disk(capsys, disk, out, run(later, "pt", out), os.path.getsize(out) // 2)
    assert torch.load(out, weights_only=True)["model"]
    os.remove(out)

    out = os.path.join(disk, "net.safetensors")
    optimizer = os.path.join(disk, "net.optimizer.pth")
    write_first("safetensors", out)
    _fails_on_full_disk(capsys, disk, out, run(later, "safetensors", out),
                        os.path.getsize(out) // 2)
    # room for the new model file, not for the (larger) optimizer file: neither is replaced
    room = _pages(disk, ["net.safetensors"])
    assert _pages(disk, ["net.optimizer.pth"]) > room
    _fails_on_full_disk(capsys, disk, optimizer, run(later, "safetensors", out), room)
    assert load_file(out)
    os.remove(out)
    os.remove(optimizer)

    out = os.path.join(disk, "resharded")
    write_first("pt", out, "--reshard", "2")
    message = _fails_on_full_disk(capsys, disk, None, run(later, "pt", out, "--reshard", "2"),
                                  size_of(disk, "resharded") // 2)
    assert message.startswith(f"{out}_rank-0000000"), message
    for name in os.listdir(disk):
        if name.startswith("resharded"):
            os.remove(os.path.join(disk, name))

    out = os.path.join(disk, "net_hf")
    write_first("hf", out)
    message = _fails_on_full_disk(capsys, disk, None, run(later, "hf", out),
                                  size_of(out) // 2)
    assert message.startswith(os.path.join(out, "model.safetensors") + ": not written"), message
    assert load_file(os.path.join(out, "model.safetensors"))
    shutil.rmtree(out)

    out = os.path.join(disk, "net_dcp")
    write_first("dcp", out)
    data = [n for n in os.listdir(out) if n.endswith(".distcp")]
    message = _fails_on_full_disk(capsys, disk, None, run(later, "dcp", out),
                                  size_of(out, "__") // 2)  # the data does not fit
    assert message.startswith(out + "/__0_") and ".distcp: not written" in message, message
    # the data fits, its .metadata does not
    _fails_on_full_disk(capsys, disk, os.path.join(out, ".metadata"), run(later, "dcp", out),
                        _pages(out, data))
    dcp_to_torch_save(out, str(tmp_path / "from_dcp.pth"))  # the previous output still reads


@pytest.mark.slow
def test_example_on_a_full_disk(small_disk):
    """The report this test comes from: ``examples/train_lm.py --checkpoint-every`` on a
    disk that holds the first run's saves and half of another. The next run's first save
    fails with the file named, leaves none of its files, and the first run's still resumes."""
    from ..examples.test_train_lm import ROOT, SMALL
    out = small_disk("example", 8 << 20)

    def run(*args):
        return subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_lm.py"),
                               "--out", out, *SMALL, "--devices", "2", *args],
                              capture_output=True, text=True, timeout=600)

    assert run("--steps", "4").returncode == 0
    ckpt = os.path.join(out, "ckpt")
    leave_free(out, size_of(os.path.join(ckpt, "step000004")) // 2)
    before = state(out)
    done = run("--steps", "8", "--resume")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "train_lm.py: rank " in done.stderr or "train_lm.py: /" in done.stderr, done.stderr
    assert "step000006/checkpoint_rank-0000000" in done.stderr and "no space left" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert state(out) == before  # nothing of the failed save; the first one and 'latest' kept
    assert re.search(r"step +5/8", done.stderr)  # it resumed from the first save
