"""A tiny Llama with other wrappers between and inside our units: torch's checkpoint wrapper
applied around the units after wrapping (PyTorch's recipe order) and inside a unit before,
``torch.compile`` on a module inside a unit, and PEFT's LoRA model as the root's module.
Each case saves torch_xla's recipe, ``save_sharded`` and a recipe file as the code before
[Note: names are the state dict's] wrote it (units named by module path)."""
from __future__ import annotations

import functools
import os
from typing import Any, Dict

import torch
# Imported here, never inside the launched function: lazy imports race in device threads.
from peft import LoraConfig, get_peft_model
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing, checkpoint_wrapper)
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from xla_fsdp.wrap import transformer_auto_wrap_policy

CONFIG = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
              use_cache=False, tie_word_embeddings=False, attn_implementation="eager")
CASES = ("checkpoint_around_units", "checkpoint_inside_unit", "compile_inside_unit", "peft")
WORLD = 2


def plain(case: str) -> torch.nn.Module:
    """The unwrapped model of ``case``: what its state dict names must equal."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    if case == "checkpoint_inside_unit":
        for layer in model.model.layers:
            layer.mlp = checkpoint_wrapper(layer.mlp)
    if case == "compile_inside_unit":
        for layer in model.model.layers:
            layer.mlp = torch.compile(layer.mlp, backend="eager")  # the names are what matter
    if case == "peft":
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return model


def _wrapped(case: str) -> Any:
    from xla_fsdp import FSDP
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(plain(case), auto_wrap_policy=policy)
    if case == "checkpoint_around_units":
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=checkpoint_wrapper,
            check_fn=lambda m: isinstance(m, FSDP) and m is not model)
    return model


def save_cases(rank: int, directory: str) -> Dict[str, Any]:
    import torch_xla
    from xla_fsdp.checkpoint import save_sharded
    out = {}
    for case in CASES:
        model = _wrapped(case)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                              momentum=0.9)
        if case != "compile_inside_unit":  # compiled steps on XLA are the compile issue's
            ids = (torch.arange(8).reshape(1, 8) + rank).to(torch_xla.device())
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        torch_xla.sync()
        prefix = os.path.join(directory, case)
        metadata = model.get_shard_metadata()
        state = {k: v.cpu() for k, v in model.state_dict().items()}
        torch.save({"model": state, "shard_metadata": metadata},
                   f"{prefix}-recipe_rank-{rank:08d}-of-{WORLD:08d}.pth")
        old = _as_before(model, metadata)
        torch.save({"model": state, "shard_metadata": old},
                   f"{prefix}-old_rank-{rank:08d}-of-{WORLD:08d}.pth")
        save_sharded(f"{prefix}-ours", model, opt)
        out[case] = {"full": model.full_state_dict(), "metadata_keys": sorted(
            f"{p}.{n}" if p else n for p, d in metadata["shard_info"].items() for n in d),
            "state_keys": sorted(state)}
    return out


def _as_before(model: Any, metadata: Dict[str, Any]) -> Dict[str, Any]:
    """The metadata with units named by their module path, as written before the fix."""
    from xla_fsdp.checkpoint.live_model import units_by_saved_path
    rename = {saved: path for (path, _), (saved, _) in zip(
        model.named_units(), units_by_saved_path(model, model.named_units()), strict=True)}
    old = dict(metadata)
    for field in ("shard_info", "layout_info", "shared_info"):
        old[field] = {rename.get(k, k): v for k, v in metadata[field].items()}
    return old


GROUPED_KEPT = ("before", "after")   # where a grouped unit is also kept as an attribute


class Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        dims = [16, 24, 40, 56, 8]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def grouped_kept(rank: int, directory: str) -> Dict[str, Any]:
    """A grouped unit (the first and last layers) also kept as an attribute of the model,
    set before the root is built or after it: the unit is then in the state dict under two
    names, and every save must name its parameters and optimizer state from where the root
    attached it. Saves per-rank files and a consolidated file with the optimizer; returns
    each case's full state dict keys and the consolidated file's path."""
    import torch_xla
    from xla_fsdp import FSDP
    from xla_fsdp.checkpoint import save_consolidated, save_sharded
    out = {}
    for where in GROUPED_KEPT:
        torch.manual_seed(0)
        model = Chain()
        ends = FSDP([model.layers[0], model.layers[3]])
        if where == "before":
            model.ends = ends
        model.layers[1], model.layers[2] = FSDP(model.layers[1]), FSDP(model.layers[2])
        root = FSDP(model)
        if where == "after":
            root.ends = ends
        opt = torch.optim.SGD(root.parameters(), lr=0.1, momentum=0.9)
        root(torch.randn(4, 16).to(torch_xla.device())).sum().backward()
        opt.step()
        torch_xla.sync()
        prefix = os.path.join(directory, f"grouped-{where}")
        save_sharded(prefix, root, opt)
        written = save_consolidated(f"{prefix}-consolidated.pth", root, opt)
        out[where] = {"full": sorted(root.full_state_dict(rank0_only=False)),
                      "consolidated": written}
    return out
