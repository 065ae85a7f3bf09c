"""A DCP directory's ``.metadata`` is read admitting only DCP's metadata classes
(``formats/dcp/metadata_file.py``), on every path that reads one: ``read_metadata``, ``DcpSource``
(``load_dcp``), ``open_consolidated`` (``load_consolidated``) and the CLI's verification of
its ``--format dcp`` output. A crafted file runs nothing and is refused naming the file and
the global; what ``dcp.save`` writes reads as DCP's own reader reads it. Objects saved beside
the tensors are read as ``torch.load(weights_only=True)`` reads them. No XLA; a few seconds.
(Through the public ``load_dcp`` and ``load_consolidated``: ``test_roundtrip.py``'s refusals.)
"""
import os
import pathlib
import pickle
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import metadata as legacy
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta,
                                                   TensorStorageMetadata)

from xla_fsdp.checkpoint.writers.formats import verify_written
from xla_fsdp.checkpoint.formats.dcp.layout import key_scheme
from xla_fsdp.checkpoint.sources.dcp_files import DcpSource, read_metadata
from xla_fsdp.checkpoint.formats.dcp.metadata_file import read_metadata_file
from xla_fsdp.checkpoint.files import CheckpointError
from xla_fsdp.checkpoint.sources.consolidated_files import open_consolidated


class _Opens:
    """Unpickling this creates ``path``: what a hostile checkpoint would do, observably."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


class _Runs:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _save(directory, state):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves alone
        dcp.save(state, checkpoint_id=str(directory))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real DCP directory: ``dcp.save`` in one process, as torch 2.9 writes it."""
    directory = tmp_path_factory.mktemp("dcp") / "ckpt"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    _save(directory, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                      "extra": {"step": 3, "name": "x", "order": OrderedDict(a=1)},
                      "bf16": torch.ones(3, dtype=torch.bfloat16)})
    return directory


def _hostile(tmp_path, saved, payload):
    """A copy of ``saved`` whose ``.metadata`` is ``payload``."""
    directory = tmp_path / "hostile"
    directory.mkdir()
    for name in os.listdir(saved):
        (directory / name).write_bytes((saved / name).read_bytes())
    (directory / ".metadata").write_bytes(payload)
    return directory


READERS = {
    "read_metadata": lambda d: read_metadata(str(d)),
    "DcpSource (load_dcp)": lambda d: DcpSource(str(d)),
    "open_consolidated (load_consolidated)": lambda d: open_consolidated(str(d)),
    "verify_written (the CLI's --format dcp)": lambda d: verify_written(
        "dcp", [str(d)], {}, False, key_scheme("get_state_dict")),
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("where", ["alone", "inside"])
def test_a_crafted_metadata_runs_nothing_and_is_refused(tmp_path, saved, reader, where):
    marker = tmp_path / "marker"
    evil = _Opens(str(marker))
    if where == "inside":  # past DCP's own classes, deep in a genuine Metadata
        real = read_metadata_file(str(saved / ".metadata"))
        evil = Metadata(real.state_dict_metadata, planner_data={"extra": [("extra", evil)]},
                        storage_data=real.storage_data)
    directory = _hostile(tmp_path, saved, pickle.dumps(evil))
    with pytest.raises(CheckpointError) as err:
        READERS[reader](directory)
    assert not marker.exists(), "the pickle's code ran"
    message = str(err.value)
    assert str(directory / ".metadata") in message
    assert "io.open" in message and "holds only DCP's metadata classes" in message, message


def test_a_shell_command_is_refused_by_name(tmp_path, saved):
    marker = tmp_path / "touched"
    directory = _hostile(tmp_path, saved, pickle.dumps(_Runs(f"touch {marker}")))
    with pytest.raises(CheckpointError, match=r"\.metadata: refuses to load posix\.system"):
        read_metadata(str(directory))
    assert not marker.exists()


def test_a_class_is_never_changed(tmp_path):
    """Pickle's BUILD on an admitted class, not an instance, would set attributes on torch's
    class for the whole process (see [Note: building only instances])."""
    crafted = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"
               b"N}X\x0c\x00\x00\x00__getstate__ccollections\nOrderedDict\ns\x86b.")
    assert "__getstate__" not in Metadata.__dict__
    path = tmp_path / ".metadata"
    path.write_bytes(crafted)
    with pytest.raises(CheckpointError, match="refuses to set the state of the class "
                                              "torch.distributed.checkpoint.metadata"):
        read_metadata_file(str(path))
    assert "__getstate__" not in Metadata.__dict__  # or every later .metadata pickles empty


def test_persistent_ids_and_garbage_are_refused(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(b"\x80\x02X\x01\x00\x00\x00xQ.")  # BINPERSID
    with pytest.raises(CheckpointError, match="refuses a persistent id"):
        read_metadata_file(str(path))
    path.write_bytes(pickle.dumps(Metadata({}, storage_data={}))[:-7])
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read"):
        read_metadata_file(str(path))
    path.write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CheckpointError, match="holds a dict, not DCP's Metadata"):
        read_metadata_file(str(path))


def test_what_dcp_save_writes_reads_as_dcps_reader_reads_it(saved):
    ours = read_metadata_file(str(saved / ".metadata"))
    theirs = dcp.FileSystemReader(str(saved)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data and ours.version == theirs.version
    assert ours.storage_meta.checkpoint_id == pathlib.PurePosixPath(saved)
    assert ours.state_dict_metadata["bf16"].properties.dtype == torch.bfloat16


def test_older_spellings_read(tmp_path):
    """torch 2.0 and 2.1 pickled TensorProperties from the sharded tensor's module; a save on
    Windows pickles its path as a WindowsPath, which cannot be made on Linux."""
    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))
    entry = TensorStorageMetadata(legacy.TensorProperties(dtype=torch.float16), torch.Size([2]),
                                  [chunk])
    metadata = Metadata({"w": entry}, storage_data={MetadataIndex("w", [0]): None},
                        storage_meta=StorageMeta(pathlib.PureWindowsPath("C:/ckpt")))
    data = pickle.dumps(metadata, protocol=2)
    assert b"cpathlib\nPureWindowsPath\n" in data
    path = tmp_path / ".metadata"
    path.write_bytes(data.replace(b"cpathlib\nPureWindowsPath\n", b"cpathlib\nWindowsPath\n"))
    got = read_metadata_file(str(path))
    assert got.state_dict_metadata["w"].properties.dtype == torch.float16
    assert got.storage_meta.checkpoint_id == pathlib.PureWindowsPath("C:/ckpt")


def test_an_object_beside_the_tensors_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    directory = tmp_path / "objects"
    _save(directory, {"w": torch.ones(2), "extra": _Opens(str(marker))})
    assert not marker.exists()
    source = DcpSource(str(directory))
    with pytest.raises(CheckpointError) as err:
        source.read({}, {"extra": None}, {})
    assert not marker.exists(), "the pickle's code ran"
    message = str(err.value)
    assert message.startswith(str(directory)) and ".distcp: entry 'extra'" in message, message
    assert "io.open" in message and "weights_only=True" in message, message
