"""The HF directory's pure parts: files split as ``save_pretrained`` splits them, sizes read as
it reads them, tied names dropped as it drops them."""
import random

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards

from xla_fsdp.checkpoint.consolidate.hf_output import (parse_size, split_into_files,
                                                        tied_names_to_drop)
from xla_fsdp.checkpoint.files import CheckpointError


@pytest.mark.parametrize("seed", range(20))
def test_files_split_as_huggingface_hub_splits_them(seed):
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int64]
    state = {f"w{i}": torch.zeros(rng.randint(1, 400), dtype=rng.choice(dtypes))
             for i in range(rng.randint(1, 30))}
    limit = rng.choice([100, 500, 1000, 4000, 10**9])
    want = split_torch_state_dict_into_shards(state, max_shard_size=limit)
    got = split_into_files([(k, v.dtype, tuple(v.shape)) for k, v in state.items()], limit)
    assert {f: [n for n, _, _ in entries] for f, entries in got} == want.filename_to_tensors


def test_sizes_are_read_as_save_pretrained_reads_them():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size(123) == 123
    with pytest.raises(CheckpointError, match="'5 apples'"):
        parse_size("5 apples")


def test_tied_names_follow_the_model_class_then_the_first_registered():
    aliases = [("lm_head.weight", "model.embed_tokens.weight")]
    assert tied_names_to_drop(aliases, [r"lm_head.weight"]) == ["lm_head.weight"]
    assert tied_names_to_drop(aliases, None) == ["lm_head.weight"]
    # the class names the embedding as the tied one: it goes, the head stays
    assert tied_names_to_drop(aliases, [r"embed_tokens"]) == ["model.embed_tokens.weight"]
    three = [("b", "a"), ("c", "a")]
    assert sorted(tied_names_to_drop(three, None)) == ["b", "c"]
