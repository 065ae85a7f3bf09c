"""A tiny tied-embedding Llama trained sharded, saved as per-rank files and consolidated from
training code in every format (``save_consolidated``), each rank in a directory of its own."""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Dict, Iterator, List

import torch
# Imported here, never inside the launched function: lazy imports race in device threads.
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from xla_fsdp.wrap import transformer_auto_wrap_policy

CONFIG = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
              use_cache=False, tie_word_embeddings=True, attn_implementation="eager")
FORMATS = ("pt", "safetensors", "hf", "dcp")
WORLD = 4


@contextlib.contextmanager
def _writer_gathers(rank: int) -> Iterator[List[str]]:
    """On rank 0, the writer, the tensors its ``save_consolidated`` gathers, in order; the
    other ranks, whose threads share the class, leave it alone and record nothing."""
    from xla_fsdp.checkpoint.per_rank import gathered
    original, tids = gathered._Channel._gather, []
    if rank != 0:
        yield tids
        return

    def recording(channel: Any, tid: str) -> Any:
        if channel._writes:
            tids.append(tid)
        return original(channel, tid)
    gathered._Channel._gather = recording
    try:
        yield tids
    finally:
        gathered._Channel._gather = original


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def save_everything(rank: int, root: str) -> Dict[str, Any]:
    """Every rank writes only under ``root/rank-<r>``; returns what each call returned and,
    on rank 0, the full state dict to compare with."""
    import torch_xla
    from xla_fsdp import FSDP
    from xla_fsdp.checkpoint import save_consolidated, save_sharded
    own = os.path.join(root, f"rank-{rank}")
    os.makedirs(own, exist_ok=True)
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(llama(), auto_wrap_policy=policy, flatten_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(32).reshape(4, 8) % 100
    ids = ids[rank:rank + 1].to(torch_xla.device())
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    torch_xla.sync()
    save_sharded(os.path.join(root, "shared", "ck"), model, opt, extra={"step": 1})
    out: Dict[str, Any] = {"gathered": {}}
    for fmt in FORMATS:
        with _writer_gathers(rank) as gathered:
            out[fmt] = save_consolidated(os.path.join(own, f"online_{fmt}"), model, opt,
                                         format=fmt, extra={"step": 1})
        out["gathered"][fmt] = gathered
    try:
        save_consolidated(os.path.join(own, "bad"), model, opt, format="hf",
                          hf_config=os.path.join(root, "wrong_config"))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["refused"] = f"{type(exc).__name__}: {exc}"
    out["full"] = model.full_state_dict()
    out["files"] = sorted(os.listdir(own))
    return out
