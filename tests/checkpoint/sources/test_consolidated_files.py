"""A consolidated ``torch.save`` file is read only after its records' CRC-32s are checked, as
per-rank files are: the ranks that open it together check each record once. No XLA."""
import gc
import os

import pytest
import torch

from xla_fsdp.checkpoint.files import CheckpointError
from xla_fsdp.checkpoint.sources.consolidated_files import open_consolidated

from ...support.synthetic_checkpoints import flip_a_tensor_byte


def _corrupted(tmp_path):
    """A consolidated file of two tensors, one byte inside the larger one's record flipped."""
    path = str(tmp_path / "full.pth")
    torch.save({"model": {"w": torch.arange(64.0), "b": torch.ones(3)}}, path)
    flip_a_tensor_byte(path)
    return path


def test_a_corrupted_record_is_refused_naming_the_file(tmp_path):
    path = _corrupted(tmp_path)
    with pytest.raises(CheckpointError, match=r"full\.pth: record .* fails its CRC-32 check"):
        open_consolidated(path)


def test_ranks_sharing_the_check_find_it_once(tmp_path):
    path = _corrupted(tmp_path)
    refused = []
    for share in ((0, 2), (1, 2)):
        try:
            open_consolidated(path, crc_share=share).close()
            refused.append(False)
        except CheckpointError:
            refused.append(True)
    assert sorted(refused) == [False, True]
    open_consolidated(path, crc_share=None).close()   # a caller that checked them itself


def test_a_refused_optimizer_state_leaves_no_file_open(tmp_path):
    # a refusal after the file was opened (here: an optimizer state without param_groups)
    # closes it; it was left open before the sources closed what they open in one stack
    path = str(tmp_path / "full.pth")
    torch.save({"model": {"w": torch.ones(3)}, "optimizer": {"state": {}}}, path)
    open_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(CheckpointError, match=r"full\.pth: the optimizer state is not an"):
        open_consolidated(path)
    gc.collect()
    still_open = [os.readlink(f"/proc/self/fd/{fd}") for fd in
                  set(os.listdir("/proc/self/fd")) - open_before
                  if os.path.exists(f"/proc/self/fd/{fd}")]
    assert path not in still_open
