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

from .checkpoint_workloads import frames_keeping

CONFIG = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
              use_cache=False, tie_word_embeddings=True, attn_implementation="eager")
FORMATS = ("pt", "safetensors", "hf", "dcp")
WORLD = 4


@contextlib.contextmanager
def _writer_gathers(rank: int) -> Iterator[List[List[str]]]:
    """On rank 0, the writer, the runs of tensors its ``save_consolidated`` gathers, in order
    (one sync each); the other ranks, whose threads share the class, leave it alone and
    record nothing."""
    from xla_fsdp.checkpoint import gathered_state as gathered
    original, runs = gathered.Gathers._gather, []
    if rank != 0:
        yield runs
        return

    def recording(gathers: Any, run: List[str]) -> Any:
        if gathers._keep:
            runs.append(list(run))
        return original(gathers, run)
    gathered.Gathers._gather = recording
    try:
        yield runs
    finally:
        gathered.Gathers._gather = original


@contextlib.contextmanager
def _one_tensor_per_sync() -> Iterator[None]:
    """Every rank's consolidated saves gather one tensor per sync, so that a writer reading
    out of the order every rank gathers in would fail. The ranks change the limit between
    two rendezvous: none is saving while another changes it."""
    import torch_xla.core.xla_model as xm
    from xla_fsdp.checkpoint import coordination
    default = coordination.GATHERED_PER_SYNC_BYTES
    xm.rendezvous("one_tensor_per_sync.in")
    coordination.GATHERED_PER_SYNC_BYTES = 1
    try:
        yield
    finally:
        xm.rendezvous("one_tensor_per_sync.out")
        coordination.GATHERED_PER_SYNC_BYTES = default


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
    # a device tensor in ``extra``: every save keeps it on the host
    extra = {"step": 1, "seen": torch.arange(3.0).to(torch_xla.device())}
    save_sharded(os.path.join(root, "shared", "ck"), model, opt, extra=extra)
    out: Dict[str, Any] = {"gathered": {}}
    with _one_tensor_per_sync():
        for fmt in FORMATS:
            with _writer_gathers(rank) as gathered:
                out[fmt] = save_consolidated(os.path.join(own, f"online_{fmt}"), model, opt,
                                             format=fmt, extra=extra)
            out["gathered"][fmt] = gathered
    with _writer_gathers(rank) as gathered:
        save_consolidated(os.path.join(own, "online_one_sync"), model, opt, extra=extra)
    out["gathered"]["one_sync"] = gathered
    try:
        save_consolidated(os.path.join(own, "bad"), model, opt, format="hf",
                          hf_config=os.path.join(root, "wrong_config"))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["refused"] = f"{type(exc).__name__}: {exc}"
        out["kept_by"] = frames_keeping(exc)
    out["full"] = model.full_state_dict()
    out["files"] = sorted(os.listdir(own))
    return out
