"""The HF directory's pure parts: files split as ``save_pretrained`` splits them, sizes read as
it reads them, tied names dropped as it drops them."""
import random

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards

from xla_fsdp.checkpoint.writers.hf_directory import (hf_directory, parse_size, split_into_files,
                                                      tied_names_to_drop)
from xla_fsdp.checkpoint.files import CheckpointError
from ...support.checks import nonempty


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


@pytest.mark.parametrize("name", ["base_model.model.model.layers.0.self_attn.q_proj.weight",
                                  "model.layers.0.self_attn.q_proj.lora_A.default.weight"])
def test_a_peft_model_is_refused_with_the_routes_that_work(tmp_path, name):
    """Its names are the PeftModel's, which from_pretrained of the base class cannot load."""
    specs = [("model.norm.weight", torch.float32, (4,)), (name, torch.float32, (4, 4))]
    entries = iter([("model.norm.weight", torch.ones(4)), (name, torch.ones(4, 4))])
    out = tmp_path / "hf"
    with pytest.raises(CheckpointError, match="PEFT model .*merge_and_unload"):
        hf_directory(str(out), specs, entries, [], "", None, "5GB", lambda n: None)
    assert not out.exists()


def test_a_tensor_over_the_limit_between_others_gets_its_own_file(tmp_path):
    """huggingface_hub gives a tensor over the limit a file of its own, numbered before the
    file still filling: the files are then not runs of the writing order, and each is still
    written with exactly its tensors (an untied head over a small limit, between layers)."""
    from safetensors.torch import load_file
    state = {"a": torch.arange(10.), "big": torch.arange(100.), "b": torch.arange(20.),
             "c": torch.arange(30.)}
    specs = [(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    out = tmp_path / "hf"
    hf_directory(str(out), specs, iter(state.items()), [], "", None, 200, lambda n: None)
    want = split_torch_state_dict_into_shards(state, max_shard_size=200).filename_to_tensors
    assert list(want) == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                          "model-00003-of-00003.safetensors"]
    assert want["model-00001-of-00003.safetensors"] == ["big"]   # before "a"'s file
    for f, names in nonempty(want.items(), "files"):
        got = load_file(str(out / f))
        assert sorted(got) == sorted(names), f
        for n in nonempty(names, f"tensors of {f}"):
            assert torch.equal(got[n], state[n]), n


def test_a_directory_with_a_config_is_not_rewritten_without_one(tmp_path):
    """An earlier save's config.json would stay beside weights it may not describe."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "llama"}\n')
    state = {"a": torch.arange(10.)}
    with pytest.raises(CheckpointError, match="holds a config.json, which this save"):
        hf_directory(str(out), [("a", torch.float32, (10,))], iter(state.items()), [], "",
                     None, "5GB", lambda n: None)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_the_models_own_config_names_its_class_as_save_pretrained_does(tmp_path):
    import json
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16,
                                       n_positions=8))
    assert not model.config.architectures
    state = model.state_dict()
    specs = [(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    out = tmp_path / "hf"
    hf_directory(str(out), specs, iter(state.items()), [("lm_head.weight",
                                                        "transformer.wte.weight")],
                 "", model, "5GB", lambda n: None)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert GPT2LMHeadModel.from_pretrained(str(out)).state_dict().keys() == state.keys()
