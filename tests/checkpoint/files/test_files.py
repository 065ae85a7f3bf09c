"""Checkpoint file reading, streaming writing and atomic replacement. No XLA."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from xla_fsdp.checkpoint.files import CheckpointError, CheckpointFile, TorchFileWriter, atomic_path


def test_lazy_reader_reads_what_torch_save_wrote(tmp_path):
    base = torch.arange(40.).reshape(5, 8)
    tree = {"m": {"a": base, "t": base.t(), "view": base[2:4], "half": base.to(torch.bfloat16),
                  "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4)},
            "plain": [1, "x", (2.0, None)]}
    torch.save(tree, tmp_path / "f.pth")
    with CheckpointFile(str(tmp_path / "f.pth")) as f:
        f.verify()
        for k, v in tree["m"].items():
            got = f.tree["m"][k].read()
            assert got.dtype == v.dtype and torch.equal(got, v), k
        out = torch.empty(5)
        f.tree["m"]["view"].read_elements(3, out)  # elements 3..7 of a view at offset 16
        assert torch.equal(out, base[2:4].reshape(-1)[3:8])
        assert f.tree["plain"] == [1, "x", (2.0, None)]


def test_reader_refuses_arbitrary_globals(tmp_path):
    torch.save({"x": torch.ones(1), "f": os.getcwd}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError, match="posix.getcwd"):
        CheckpointFile(str(tmp_path / "evil.pth"))


def test_streaming_writer_output_loads_with_torch_load(tmp_path):
    path = str(tmp_path / "w.pth")
    writer = TorchFileWriter(path)
    big = torch.arange(100.)
    weight = writer.add(torch.randn(4, 3))
    tree = {"model": {"w": weight, "tied": weight, "slice": writer.add(big[10:20]),
                      "bf16": writer.add(torch.ones(3, dtype=torch.bfloat16))},
            "later": torch.full((2,), 7.0), "n": 3}
    writer.finish(tree)
    for mmap in (False, True):
        got = torch.load(path, weights_only=True, mmap=mmap)
        assert torch.equal(got["model"]["slice"], big[10:20])
        assert got["model"]["w"].data_ptr() == got["model"]["tied"].data_ptr()
        assert got["model"]["bf16"].dtype == torch.bfloat16
        assert torch.equal(got["later"], torch.full((2,), 7.0)) and got["n"] == 3
    with CheckpointFile(path) as f:
        f.verify()


def test_atomic_path_keeps_the_old_file_on_error(tmp_path):
    path = tmp_path / "c.pth"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_path(str(path)) as tmp:
            open(tmp, "wb").write(b"half")
            raise RuntimeError("crash")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["c.pth"]


_SAVER = textwrap.dedent("""
    import sys, torch
    from xla_fsdp.checkpoint.files import atomic_path
    path = sys.argv[1]
    for version in range(1, 1000):
        state = {"version": version, "weights": torch.full((25_000_000,), float(version))}
        with atomic_path(path) as tmp:
            torch.save(state, tmp)
        print(version, flush=True)
""")


def _partial_temp_files(directory):
    return [n for n in os.listdir(directory)
            if n.startswith(".ckpt.pth.tmp-") and os.path.getsize(directory / n) > 0]


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt.pth")
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, path], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "1"   # the first save completed
        deadline = time.monotonic() + 60
        while not _partial_temp_files(tmp_path):
            assert time.monotonic() < deadline, "the second save never started"
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)              # mid-way through the second save
        proc.wait()
    finally:
        proc.kill()
    assert _partial_temp_files(tmp_path), "the kill did not land inside a save"
    with CheckpointFile(path) as f:
        f.verify()
    state = torch.load(path, weights_only=True)
    assert state["version"] >= 1
    assert torch.equal(state["weights"], torch.full((25_000_000,), float(state["version"])))
