"""One verifier of what a consolidation wrote, for every format: what the writer meant to
store must be what the loader's reader finds (names, dtypes, shapes, nothing more), the
optimizer's param groups when it was written, a torch file's CRC-32s. No XLA."""
import pytest
import torch

from xla_fsdp.checkpoint.consolidate import main
from xla_fsdp.checkpoint.consolidate.library import output_paths
from xla_fsdp.checkpoint.writers.formats import verify_written
from xla_fsdp.checkpoint.formats.dcp.layout import key_scheme
from xla_fsdp.checkpoint.files import CheckpointError, CheckpointFile

from ...support.checks import nonempty
from ...support.synthetic_checkpoints import full_model, write_set

CASES = [("pt", "get_state_dict", ""), ("safetensors", "get_state_dict", ""),
         ("safetensors", "get_state_dict", "weights"), ("hf", "get_state_dict", ""),
         ("dcp", "get_state_dict", ""), ("dcp", "torchtitan", "")]


def _written(tmp_path, fmt, keys, save_path=""):
    """A consolidation's outputs; ``save_path`` need not end as its format's files do."""
    prefix = str(tmp_path / "ck")
    write_set(prefix, 3)
    assert main(["--ckpt_prefix", prefix, "--format", fmt, "--dcp_keys", keys,
                 "--save_path", save_path]) == 0
    written = output_paths(fmt, save_path, prefix)
    expected = {n: (t.dtype, tuple(t.shape)) for n, t in full_model().items()}
    return written, expected, fmt != "hf"


@pytest.mark.parametrize("fmt, keys, name", CASES)
def test_what_was_written_verifies_and_anything_else_is_refused(tmp_path, fmt, keys, name):
    written, expected, with_optimizer = _written(tmp_path, fmt, keys,
                                                 name and str(tmp_path / name))
    scheme = key_scheme(keys)
    assert verify_written(fmt, written, expected, with_optimizer, scheme).startswith("2 tensors")
    first = next(iter(expected))
    wrong = [dict(expected, **{"lin.extra": (torch.float32, (1,))}),
             {k: v for k, v in expected.items() if k != first},
             dict(expected, **{first: (torch.float64, expected[first][1])})]
    for bad in nonempty(wrong, "wrong inputs"):
        with pytest.raises(CheckpointError, match="does not hold what was written"):
            verify_written(fmt, written, bad, with_optimizer, scheme)
    if not with_optimizer:
        with pytest.raises(CheckpointError, match="no optimizer param groups"):
            verify_written(fmt, written, expected, True, scheme)


def test_a_torch_file_is_checked_by_its_crcs(tmp_path):
    written, expected, _ = _written(tmp_path, "pt", "get_state_dict")
    with CheckpointFile(written[0]) as f:
        offset = f._data_offset(f.tree["model"]["lin.weight"].key)
    data = bytearray(open(written[0], "rb").read())
    data[offset + 3] ^= 0x40
    with open(written[0], "wb") as f:
        f.write(bytes(data))
    with pytest.raises(CheckpointError, match="CRC-32"):
        verify_written("pt", written, expected, True)
