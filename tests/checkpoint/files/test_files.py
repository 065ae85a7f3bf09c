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

from ...support.checks import every, nonempty


def test_lazy_reader_reads_what_torch_save_wrote(tmp_path):
    base = torch.arange(40.).reshape(5, 8)
    tree = {"m": {"a": base, "t": base.t(), "view": base[2:4], "half": base.to(torch.bfloat16),
                  "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4)},
            "plain": [1, "x", (2.0, None)]}
    torch.save(tree, tmp_path / "f.pth")
    with CheckpointFile(str(tmp_path / "f.pth")) as f:
        f.verify()
        for k, v in nonempty(tree["m"].items(), "tensors"):
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


def _flip(path, at):
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0x10
    open(path, "wb").write(data)


def test_our_safetensors_files_carry_each_tensor_s_crc(tmp_path):
    """[Note: checksums in a safetensors header]: a byte flipped inside a tensor is named;
    safetensors' own reader takes the file as before; a file without the list (written by
    another tool) has nothing to check."""
    import json
    import struct

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from xla_fsdp.checkpoint.files import SafetensorsFile
    from xla_fsdp.checkpoint.files.writer import CRC_KEY, SafetensorsWriter
    path = str(tmp_path / "ours.safetensors")
    tensors = {"a.weight": torch.randn(3, 4), "b": torch.arange(5), "empty": torch.zeros(0),
               "c": torch.ones(2, dtype=torch.bfloat16)}
    writer = SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()],
                               {"format": "pt"})
    for name, t in tensors.items():
        writer.add(name, t)
    writer.finish()
    assert every(torch.equal(v, tensors[k]) for k, v in load_file(path).items())
    with safe_open(path, "pt") as f:
        assert f.metadata()["format"] == "pt" and len(f.metadata()[CRC_KEY]) == 8 * 4
    with SafetensorsFile(path) as f:
        f.verify()
    (length,) = struct.unpack("<Q", open(path, "rb").read(8))
    begin = json.loads(open(path, "rb").read(8 + length)[8:])["b"]["data_offsets"][0]
    _flip(path, 8 + length + begin + 9)
    with SafetensorsFile(path) as f:
        with pytest.raises(CheckpointError, match=r"ours.safetensors: tensor 'b' fails its "
                                                  r"CRC-32 check"):
            f.verify()
        f.verify((0, 2))   # the readers sharing it: 'b', the second by name, is another's
        with pytest.raises(CheckpointError, match="'b' fails"):
            f.verify((1, 2))
    # rewritten by safetensors' own writer, in its layout, our list kept: still true
    other = str(tmp_path / "other.safetensors")
    with safe_open(path, "pt") as f:
        save_file(tensors, other, metadata=f.metadata())
    with SafetensorsFile(other) as f:
        f.verify()
    save_file(tensors, other)
    _flip(other, os.path.getsize(other) - 1)
    with SafetensorsFile(other) as f:
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
