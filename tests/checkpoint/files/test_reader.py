"""The lazy reader of torch.save files runs nothing a crafted ``data.pkl`` names, changes no
class of torch's, and says which file is at fault (and closes it). No XLA."""
import os
import zipfile

import pytest
import torch

from xla_fsdp.checkpoint.files import CheckpointError, CheckpointFile


class _Opens:
    """Unpickling this creates ``path``: what a hostile checkpoint would do, observably."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _with_pickle(path, data_pkl):
    """A torch.save-shaped zip whose ``data.pkl`` is ``data_pkl``."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/version", "3\n")
    return str(path)


def _open_fds():
    return set(os.listdir("/proc/self/fd"))


def test_a_crafted_pickle_in_a_torch_save_file_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    torch.save({"w": torch.ones(2), "evil": _Opens(str(marker))}, tmp_path / "evil.pth")
    fds = _open_fds()
    with pytest.raises(CheckpointError, match=r"evil\.pth: holds io\.open"):
        CheckpointFile(str(tmp_path / "evil.pth"))
    assert not marker.exists(), "the pickle's code ran"
    assert _open_fds() <= fds, "the refused file was left open"


def test_no_class_of_torchs_is_changed(tmp_path):
    """A storage type is a Python class of torch's: BUILD on it would set an attribute for the
    whole process. The reader hands out the storage's dtype instead, which takes none."""
    crafted = b"\x80\x02ctorch\nFloatStorage\nN}X\x02\x00\x00\x00zzK\x01s\x86b."
    with pytest.raises(CheckpointError, match=r"crafted\.pth: data\.pkl is corrupted"):
        CheckpointFile(_with_pickle(tmp_path / "crafted.pth", crafted))
    assert not hasattr(torch.FloatStorage, "zz")


@pytest.mark.parametrize("data_pkl, error", [
    (b"\x80\x02X\x05\x00\x00\x00hello", "data.pkl is corrupted"),         # no STOP
    (b"\x80\x02X\x01\x00\x00\x00xQ.", "malformed persistent record"),     # BINPERSID 'x'
    (b"\x80\x02ctorch\n_dynamo\n.", "holds torch._dynamo"),                # not imported
])
def test_malformed_pickles_are_refused_naming_the_file(tmp_path, data_pkl, error):
    path = _with_pickle(tmp_path / "bad.pth", data_pkl)
    fds = _open_fds()
    with pytest.raises(CheckpointError, match="bad.pth: ") as err:
        CheckpointFile(path)
    assert error in str(err.value)
    assert _open_fds() <= fds
