"""LoRA adapters (peft) on a tiny Llama, and the launched functions of
``tests/compat/test_peft.py``: Hugging Face Trainer on them, plain data parallel or on our
FSDP through ``patch_torch_xla()``, and a loop wrapped by xla_fsdp directly, trained beside
its unsharded reference.
"""
from __future__ import annotations

import functools
import os
import traceback
from typing import Any, Dict, List

import torch
# Imported here, never inside the launched functions: lazy imports race in device threads.
import peft.peft_model
import peft.utils.save_and_load
import transformers.trainer
from peft import LoraConfig, get_peft_model
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                          TrainingArguments)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from xla_fsdp.wrap import transformer_auto_wrap_policy

IMPORTED_UP_FRONT = (transformers.trainer, peft.peft_model, peft.utils.save_and_load)

WORLD = 4
VOCAB, SEQ = 128, 12
TRAINER_STEPS, TRAINER_LR = 4, 0.05
LOOP_STEPS, LOOP_LR, MOMENTUM = 3, 0.05, 0.9
GLOBAL_BATCH = 8  # the loop's; 2 rows per rank at N = 4
SEED = 0

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
# name: (attention biases, LoraConfig arguments); every variant has what it names and LORA
VARIANTS: Dict[str, Any] = {
    "lora": (False, {}),
    # a trained copy outside every decoder-layer unit (lm_head) and one inside each
    "modules_to_save": (False, {"modules_to_save": ["lm_head", "post_attention_layernorm"]}),
    # the biases of the adapted layers are trained and saved with the adapter
    "bias_lora_only": (True, {"bias": "lora_only"}),
    # a LoRA embedding: save_embedding_layers="auto" saves the embedding's weights too
    "embedding": (False, {"target_modules": ["embed_tokens", "q_proj", "v_proj"]}),
}


def config(attention_bias: bool = False) -> LlamaConfig:
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                       max_position_embeddings=64, attention_bias=attention_bias,
                       attention_dropout=0.0, use_cache=False, tie_word_embeddings=False,
                       attn_implementation="eager")


def base_model(attention_bias: bool = False) -> LlamaForCausalLM:
    """The same initial weights every time (the frozen base of every run)."""
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config(attention_bias))


def lora_model(variant: str = "lora") -> Any:
    attention_bias, extra = VARIANTS[variant]
    base = base_model(attention_bias)
    return get_peft_model(base, LoraConfig(**{**LORA, **extra, "task_type": "CAUSAL_LM"}))


def probe_ids() -> torch.Tensor:
    """Inputs the saved models are compared on."""
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


# -- Hugging Face Trainer -------------------------------------------------------------------
class TokenData(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.tokens = torch.randint(0, VOCAB, (WORLD * 2 * TRAINER_STEPS, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def shard_facts(root: Any, optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """One entry per shard group of the wrapped model: its parameters' unwrapped names,
    whether it trains, has a gradient now, is in the optimizer and has optimizer state."""
    from xla_fsdp._sharding.names import clean_name, join_name
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    with_state = {id(p) for p in optimizer.state}
    out = []
    for path, unit in root.named_units():
        for g in unit.shard_groups:
            out.append({"names": [clean_name(join_name(path, n)) for n in g.names],
                        "trains": g.shard.requires_grad, "grad": g.shard.grad is not None,
                        "in_optimizer": id(g.shard) in in_optimizer,
                        "state": id(g.shard) in with_state})
    return out


class _GradientsAtStep(TrainerCallback):
    """Before each optimizer step, which shard groups hold a (reduced) gradient."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.steps: List[List[Dict[str, Any]]] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = self.trainer.model, self.trainer.optimizer
        if hasattr(model, "named_units"):
            self.steps.append(shard_facts(model, getattr(optimizer, "optimizer", optimizer)))


# transformers 5 always saves safetensors and no longer takes the switch
_SAFETENSORS = {} if int(transformers.__version__.split(".")[0]) >= 5 else {"save_safetensors": True}


def run_trainer(rank: int, out: str, fsdp: bool) -> Dict[str, Any]:
    if fsdp:
        from xla_fsdp import patch_torch_xla
        patch_torch_xla()
    else:  # left by an FSDP unit built earlier in the test process, it would stop DP
        os.environ.pop("ACCELERATE_USE_FSDP", None)
    model = lora_model()
    extra = {}
    if fsdp:
        extra = {"fsdp": "full_shard",
                 "fsdp_config": {"xla": True,
                                 "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    args = TrainingArguments(output_dir=out, max_steps=TRAINER_STEPS,
                             per_device_train_batch_size=2, optim="adamw_torch",
                             learning_rate=TRAINER_LR, lr_scheduler_type="constant",
                             max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                             report_to="none", dataloader_drop_last=True, seed=SEED,
                             **_SAFETENSORS, **extra)
    watch = _GradientsAtStep()
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(), callbacks=[watch])
    watch.trainer = trainer
    trainer.train()
    trainer.save_model(out)
    result: Dict[str, Any] = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "wrapped_by": type(trainer.model).__module__}
    if fsdp:
        from xla_fsdp._unit import peft_names
        optimizer = trainer.optimizer
        result["at_steps"] = watch.steps
        result["after"] = shard_facts(trainer.model, getattr(optimizer, "optimizer", optimizer))
        result["installed"] = list(peft_names._wrapped)
    return result


# -- a loop wrapped by xla_fsdp directly ----------------------------------------------------
def _batch(step: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def train_variants(rank: int, out: str, variants: List[str]) -> Dict[str, Any]:
    """Each variant wrapped (a unit per decoder layer and the root) and trained on this
    rank's slice, and unwrapped on this rank's device on the whole batch; rank 0 saves both
    adapters under ``out/<variant>/{fsdp,plain}``: the wrapped one as users do, from the
    full state dict every rank gathers."""
    results: Dict[str, Any] = {}
    for name in variants:
        try:
            results[name] = _train_variant(rank, out, name)
        except Exception:  # noqa: BLE001 - reported per variant by the test
            results[name] = {"error": traceback.format_exc()}
    results["wrapped_first"] = _wrapped_first()
    return results


def _train_variant(rank: int, out: str, name: str) -> Dict[str, Any]:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from xla_fsdp import FSDP
    from xla_fsdp.checkpoint.full_state_dict import full_state_dict

    device, world = torch_xla.device(), xr.world_size()
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={LlamaDecoderLayer})
    root = FSDP(lora_model(name), auto_wrap_policy=policy)
    # every parameter, frozen ones too: they must get neither a gradient nor state
    opt = torch.optim.SGD(root.parameters(), lr=LOOP_LR, momentum=MOMENTUM)
    plain = lora_model(name).to(device)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=LOOP_LR, momentum=MOMENTUM)
    local_rows = GLOBAL_BATCH // world
    losses, plain_losses = [], []
    for step in range(LOOP_STEPS):
        batch = _batch(step)
        local = {k: v[rank * local_rows:(rank + 1) * local_rows].to(device)
                 for k, v in batch.items()}
        opt.zero_grad()
        loss = root(**local).loss
        loss.backward()
        opt.step()
        losses.append(xm.all_reduce(xm.REDUCE_SUM, loss.detach(), scale=1.0 / world))
        torch_xla.sync()
        plain_opt.zero_grad()
        plain_loss = plain(**{k: v.to(device) for k, v in batch.items()}).loss
        plain_loss.backward()
        plain_opt.step()
        plain_losses.append(plain_loss.detach())
        torch_xla.sync()
    facts = shard_facts(root, opt)
    state_dict = full_state_dict(root)  # every rank; rank 0 gets it
    if rank == 0:
        root.module.module.save_pretrained(os.path.join(out, name, "fsdp"),
                                           state_dict=state_dict)
        plain.to("cpu").save_pretrained(os.path.join(out, name, "plain"))
    try:  # without the gathered state dict peft would read placeholders: refused
        root.module.module.save_pretrained(os.path.join(out, name, "no_state_dict"))
        no_state_dict = "saved"
    except ValueError as exc:
        no_state_dict = str(exc)
    try:  # the base model's own save_pretrained: refused too (its names are the wrapper's)
        root.module.module.get_base_model().save_pretrained(
            os.path.join(out, name, "base_no_state_dict"), safe_serialization=False)
        no_state_dict_base = "saved"
    except ValueError as exc:
        no_state_dict_base = str(exc)
    try:
        root.module.module.get_base_model().resize_token_embeddings(VOCAB + 2)
        resized = "resized"
    except ValueError as exc:
        resized = str(exc)
    return {"losses": torch.stack(losses).cpu().tolist(), "no_state_dict": no_state_dict,
            "resized": resized,
            "no_state_dict_base": no_state_dict_base,
            "plain_losses": torch.stack(plain_losses).cpu().tolist(), "shards": facts}


def _wrapped_first() -> str:
    """get_peft_model on a model already wrapped: the error its first forward raises."""
    import torch_xla
    from xla_fsdp import FSDP
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={LlamaDecoderLayer})
    root = FSDP(base_model(), auto_wrap_policy=policy)
    model = get_peft_model(root, LoraConfig(**LORA))
    ids = probe_ids().to(torch_xla.device())
    try:
        model(input_ids=ids, labels=ids)
    except ValueError as exc:
        return str(exc)
    return "no error"
