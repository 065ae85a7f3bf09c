"""A device process forked from the warm server is the process a spawned one would be: the
parent's environment (XLA's flags included) and standard output at launch, atexit handlers
run, and what they print reaches the parent; a changed import-time variable gets a spawned process ([Note: device processes fork from a warm
server])."""
import os

from xla_fsdp import launch

from ..support.checks import every, nonempty


def _report(rank, done_path):
    import atexit

    import torch
    import torch_xla
    atexit.register(lambda: open(f"{done_path}.{rank}", "w").close())
    if done_path.endswith("forked"):
        atexit.register(_late_word, rank)
    print(f"rank {rank} prints", flush=True)
    total = (torch.ones(2, device=torch_xla.device()) * (rank + 1)).sum().item()
    return {"parent": os.getppid(), "mark": os.environ.get("XLA_FSDP_TEST_MARK"),
            "flags": os.environ.get("XLA_FLAGS"), "total": total,
            "eager": os.environ.get("XLA_USE_EAGER_DEBUG_MODE")}


def _late_word(rank):
    """An exit handler that takes its time, as the report of a save never published waits
    for the save's write: what it prints reaches the parent's stderr all the same."""
    import sys
    import time
    time.sleep(1)
    print(f"rank {rank} leaves a last word", file=sys.stderr, flush=True)


def test_a_forked_device_process_is_what_a_spawned_one_is(tmp_path, monkeypatch, capfd):
    launch(_report, (str(tmp_path / "first"),), num_devices=1)  # the server runs from here
    # our own variables are read when used, never at import: still forked
    monkeypatch.setenv("XLA_FSDP_TEST_MARK", "set after the server started")
    capfd.readouterr()
    forked = launch(_report, (str(tmp_path / "forked"),), num_devices=2)
    out, err = capfd.readouterr()
    assert "rank 0 prints" in out and "rank 1 prints" in out
    assert "rank 0 leaves a last word" in err and "rank 1 leaves a last word" in err
    for rank, got in nonempty(forked.items(), "ranks"):
        assert got["parent"] != os.getpid(), "not forked from the server"
        assert got["mark"] == "set after the server started"
        assert got["total"] == 2.0 * (rank + 1)
        assert os.path.exists(tmp_path / f"forked.{rank}"), "atexit handlers did not run"

    # XLA parses its flags at the first compile, after the fork
    dump = tmp_path / "dump"
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    monkeypatch.setenv("XLA_FLAGS", flags)
    forked = launch(_report, (str(tmp_path / "flags"),), num_devices=2)
    assert every(got["parent"] != os.getpid() and got["flags"].startswith(flags)
                 for got in forked.values())
    assert os.listdir(dump), "XLA_FLAGS set after the server started had no effect"

    # a variable torch_xla reads at import: spawned, so that it takes effect
    monkeypatch.setenv("XLA_USE_EAGER_DEBUG_MODE", "0")
    spawned = launch(_report, (str(tmp_path / "spawned"),), num_devices=2)
    for rank, got in nonempty(spawned.items(), "ranks"):
        assert got["parent"] == os.getpid() and got["eager"] == "0"
        assert got["total"] == 2.0 * (rank + 1)
        assert os.path.exists(tmp_path / f"spawned.{rank}")
