"""Tiny Hugging Face architectures (and one mixture-of-experts model of our own), their
data, and the launched functions that train each of them unsharded and sharded.

The reference (``train_unsharded``) is each model built from the seed and trained plain on
one device, on the whole global batch: one launch for every world size. Each rank of a
sharded launch (``train_and_compare``) builds the same model, wraps it in FSDP, trains it
on its slice of the global batch and compares its gathered model with the reference, which
the launch is handed.
"""
from __future__ import annotations

import functools
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F
# Imported here, never inside the launched function: lazy imports race in device threads.
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel,
                          LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          T5Config, T5ForConditionalGeneration)
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
from transformers.models.t5.modeling_t5 import T5Block

from xla_fsdp.wrap import transformer_auto_wrap_policy

STEPS = 4
GLOBAL_BATCH = 8  # splits evenly at N = 2 and 4
SEQ = 8
VOCAB = 100
LR, MOMENTUM = 0.05, 0.9
SEED = 0

# -- mixture of experts -------------------------------------------------------------------
EXPERTS = 4
MOE_DIM, MOE_HIDDEN, MOE_HEADS = 32, 48, 2


def expert_of_token(tokens: torch.Tensor) -> torch.Tensor:
    """The expert each token id is steered to (see ``MoEBlock``)."""
    return tokens % EXPERTS


class MoEBlock(nn.Module):
    """Pre-norm causal self-attention, then a top-1 mixture-of-experts MLP.

    Routing is top-1 over the router's softmax scores plus a selection bias that favours
    the token's preferred expert (as in bias-adjusted, auxiliary-loss-free load balancing:
    the bias picks the expert, the unbiased score weighs its output). Scores lie in [0, 1]
    and the bias is 2, so the choice is the preferred expert whatever the router learns,
    and which experts a slice of the batch reaches is a property of the data alone.
    Dispatch and combine are one-hot einsums over every expert: the shapes never depend on
    the routing, and an expert without tokens still takes part (with zero gradients).
    """

    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(MOE_DIM)
        self.qkv = nn.Linear(MOE_DIM, 3 * MOE_DIM)
        self.proj = nn.Linear(MOE_DIM, MOE_DIM)
        self.moe_norm = nn.LayerNorm(MOE_DIM)
        self.router = nn.Linear(MOE_DIM, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, MOE_DIM, MOE_HIDDEN) * 0.1)
        self.b_in = nn.Parameter(torch.randn(EXPERTS, MOE_HIDDEN) * 0.1)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, MOE_HIDDEN, MOE_DIM) * 0.1)
        self.b_out = nn.Parameter(torch.randn(EXPERTS, MOE_DIM) * 0.1)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, MOE_HEADS, d // MOE_HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // MOE_HEADS) ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)

    def forward(self, h: torch.Tensor, preferred: torch.Tensor) -> torch.Tensor:
        h = h + self._attention(self.attn_norm(h))
        x = self.moe_norm(h)
        scores = self.router(x).softmax(-1)                        # (b, t, e)
        choice = (scores + 2.0 * preferred).argmax(-1, keepdim=True)
        experts = torch.arange(EXPERTS, device=x.device)
        dispatch = (choice == experts).to(x.dtype)                 # one-hot (b, t, e)
        gate = (scores * dispatch).sum(-1, keepdim=True)
        # read back after the step to check the routing against the data
        self.tokens_per_expert = dispatch.detach().sum((0, 1))
        routed = torch.einsum("bte,btd->ebtd", dispatch, x)
        inner = F.gelu(torch.einsum("ebtd,edh->ebth", routed, self.w_in)
                       + self.b_in[:, None, None, :])
        out = torch.einsum("ebth,ehd->ebtd", inner, self.w_out) + self.b_out[:, None, None, :]
        combined = torch.einsum("ebtd,bte->btd", out, dispatch * gate)
        return h + combined


class MoELM(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, MOE_DIM)
        self.pos = nn.Embedding(SEQ, MOE_DIM)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(layers))
        self.norm = nn.LayerNorm(MOE_DIM)
        self.head = nn.Linear(MOE_DIM, VOCAB, bias=False)
        # a persistent integer buffer: it must survive consolidation like any weight
        self.register_buffer("expert_of_token", expert_of_token(torch.arange(VOCAB)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        experts = torch.arange(EXPERTS, device=input_ids.device)
        preferred = (self.expert_of_token[input_ids].unsqueeze(-1) == experts).float()
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.embed(input_ids) + self.pos(positions)
        for block in self.blocks:
            h = block(h, preferred)
        logits = self.head(self.norm(h))
        # no load-balancing loss: it multiplies two batch means, so the ranks' average of
        # it would not be the global batch's value
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1))


# -- configs ------------------------------------------------------------------------------
def _checked(config: Any) -> Any:
    """Fails if any dropout is left on: dropout draws differ between the two runs."""
    on = {k: v for k, v in config.to_dict().items()
          if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v != 0.0}
    assert not on, f"{type(config).__name__} has dropout left on: {on}"
    return config


def gpt2() -> nn.Module:
    return GPT2LMHeadModel(_checked(GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        attn_implementation="eager")))


# Llama and Qwen2 alike: grouped-query attention (4 query heads share 2 key/value heads)
_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                attention_dropout=0.0, use_cache=False, tie_word_embeddings=False,
                attn_implementation="eager")


def llama() -> nn.Module:
    return LlamaForCausalLM(_checked(LlamaConfig(**_DECODER)))


def qwen2() -> nn.Module:
    return Qwen2ForCausalLM(_checked(Qwen2Config(**_DECODER)))


def bert() -> nn.Module:
    return BertForMaskedLM(_checked(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
        attn_implementation="eager")))


def t5() -> nn.Module:
    return T5ForConditionalGeneration(_checked(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, classifier_dropout=0.0, feed_forward_proj="relu",
        tie_word_embeddings=True, use_cache=False, pad_token_id=0, decoder_start_token_id=0,
        attn_implementation="eager")))


def moe() -> nn.Module:
    return MoELM()


# -- data -----------------------------------------------------------------------------------
# Hugging Face losses are means over the rank's own counted tokens, and FSDP averages the
# ranks' gradients. The average of local means is the global mean only when every rank
# counts the same number of tokens, so every row below counts the same number.

def _generator(name: str, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * (1 + sorted(ARCHITECTURES).index(name)) + step)


def causal_lm_batch(name: str, step: int) -> Dict[str, torch.Tensor]:
    # the model shifts the labels itself: SEQ - 1 counted tokens in every row
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=_generator(name, step))
    return {"input_ids": ids, "labels": ids.clone()}


BERT_MASKED_PER_ROW = 2


def masked_lm_batch(name: str, step: int) -> Dict[str, torch.Tensor]:
    g = _generator(name, step)
    mask_id = VOCAB - 1
    ids = torch.randint(0, VOCAB - 1, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.full_like(ids, -100)
    for row in range(GLOBAL_BATCH):  # the same number of masked positions in every row
        where = torch.randperm(SEQ, generator=g)[:BERT_MASKED_PER_ROW]
        labels[row, where] = ids[row, where]
        ids[row, where] = mask_id
    # an explicit mask: without one, the model reads the ids back to warn about padding
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def seq2seq_batch(name: str, step: int) -> Dict[str, torch.Tensor]:
    g = _generator(name, step)
    return {"input_ids": torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            "labels": torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ - 2), generator=g)}


# Which experts each row's tokens may prefer. Rows 0-1 avoid experts 2 and 3 and rows 2-3
# avoid expert 3, while rows 4-7 use all: at N = 2 rank 0 sends expert 3 nothing, at N = 4
# rank 0 sends experts 2 and 3 nothing and rank 1 expert 3, and every expert still gets
# tokens from the global batch.
MOE_ROW_EXPERTS = [(0, 1), (0, 1), (0, 1, 2), (0, 1, 2)] + [tuple(range(EXPERTS))] * 4


def moe_batch(name: str, step: int) -> Dict[str, torch.Tensor]:
    g = _generator(name, step)
    rows = []
    for allowed in MOE_ROW_EXPERTS:
        vocab = torch.tensor([t for t in range(VOCAB) if t % EXPERTS in allowed])
        rows.append(vocab[torch.randint(0, len(vocab), (SEQ,), generator=g)])
    return {"input_ids": torch.stack(rows)}


def tokens_per_expert(input_ids: torch.Tensor) -> torch.Tensor:
    """How many of these tokens each expert receives, from the data alone."""
    return torch.bincount(expert_of_token(input_ids).reshape(-1), minlength=EXPERTS)


def rank_slice(batch: Dict[str, torch.Tensor], rank: int, world: int) -> Dict[str, torch.Tensor]:
    local = GLOBAL_BATCH // world
    return {k: v[rank * local:(rank + 1) * local] for k, v in batch.items()}


# -- registry -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    build: Callable[[], nn.Module]
    block: type                    # the layer class each FSDP unit wraps
    batch: Callable[[str, int], Dict[str, torch.Tensor]]
    hf: bool = True                # a transformers model: loss in .loss, tie_weights()
    scan: str = ""                 # the layer list to run as ScannedLayers, unchanged code
    vocab_parallel: bool = False   # the vocabulary tables in row blocks, never gathered


ARCHITECTURES: Dict[str, Architecture] = {
    "gpt2": Architecture(gpt2, GPT2Block, causal_lm_batch),
    "llama": Architecture(llama, LlamaDecoderLayer, causal_lm_batch),
    "qwen2": Architecture(qwen2, Qwen2DecoderLayer, causal_lm_batch),
    "bert": Architecture(bert, BertLayer, masked_lm_batch),
    "t5": Architecture(t5, T5Block, seq2seq_batch),
    "moe": Architecture(moe, MoEBlock, moe_batch, hf=False),
    # the decoder layers as one ScannedLayers unit; the models' own loops drive it
    "llama_scanned": Architecture(llama, LlamaDecoderLayer, causal_lm_batch, scan="model.layers"),
    "qwen2_scanned": Architecture(qwen2, Qwen2DecoderLayer, causal_lm_batch, scan="model.layers"),
    "gpt2_scanned": Architecture(gpt2, GPT2Block, causal_lm_batch, scan="transformer.h"),
    # vocab_parallel: GPT-2's tied head and its position table; Llama's untied head; T5's
    # table shared by encoder, decoder and head, and each layer's relative-position table
    "gpt2_vocab_parallel": Architecture(gpt2, GPT2Block, causal_lm_batch, vocab_parallel=True),
    "llama_vocab_parallel": Architecture(llama, LlamaDecoderLayer, causal_lm_batch,
                                         vocab_parallel=True),
    "t5_vocab_parallel": Architecture(t5, T5Block, seq2seq_batch, vocab_parallel=True),
}


def loss_of(arch: Architecture, model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    if arch.hf:
        return model(**batch).loss
    return model(batch["input_ids"])


def build(name: str) -> nn.Module:
    torch.manual_seed(SEED)
    return ARCHITECTURES[name].build()


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _routing(model: nn.Module) -> torch.Tensor:
    return torch.stack([m.tokens_per_expert for m in model.modules() if isinstance(m, MoEBlock)])


# -- the launched function ------------------------------------------------------------------
def train_unsharded(rank: int, names: List[str]) -> Dict[str, Any]:
    """The reference of each architecture: trained plain on this device, on the global batch;
    per architecture, its losses and final state dict (on the CPU), or the traceback."""
    return _each_architecture(names, _train_plain)


def _each_architecture(names: List[str], train: Callable[[str], Dict[str, Any]]
                       ) -> Dict[str, Any]:
    """``train(name)`` per architecture, or ``{"error": traceback}`` where it raised."""
    results = {}
    for name in names:
        try:
            results[name] = train(name)
        except Exception as exc:  # noqa: BLE001 - reported per architecture by the test
            if type(exc).__module__.startswith("xla_fsdp.launch.virtual"):
                raise  # the launcher's own errors: the ranks are no longer in step
            results[name] = {"error": traceback.format_exc()}
    return results


def _train_plain(name: str) -> Dict[str, Any]:
    import torch_xla
    arch = ARCHITECTURES[name]
    device = torch_xla.device()
    plain = build(name)
    distinct = len(list(plain.parameters()))
    plain = plain.to(device)
    if arch.hf:
        plain.tie_weights()  # moving to XLA unties tied parameters
    assert len(list(plain.parameters())) == distinct, f"{name}: the reference is not re-tied"
    plain_opt = optimizer(plain)
    plain_losses = []
    for step in range(STEPS):
        batch = arch.batch(name, step)
        plain_opt.zero_grad()
        plain_loss = loss_of(arch, plain, {k: v.to(device) for k, v in batch.items()})
        plain_loss.backward()
        plain_opt.step()
        plain_losses.append(plain_loss.detach())
        torch_xla.sync()
    return {"plain_losses": torch.stack(plain_losses).cpu().tolist(),
            "plain_sd": {k: v.detach().cpu() for k, v in plain.state_dict().items()}}


def train_and_compare(rank: int, names: List[str], ckpt_dir: str,
                      references: Dict[str, Any]) -> Dict[str, Any]:
    """Trains each architecture sharded (this rank's slice of the global batch) and compares
    it with its reference from ``train_unsharded``: per architecture, the losses of both,
    each parameter's largest difference, the checkpoint prefix, and (rank 0) the full state
    dict, or the traceback if the architecture raised."""
    def train(name: str) -> Dict[str, Any]:
        if "error" in references[name]:
            raise RuntimeError(f"the unsharded reference raised:\n{references[name]['error']}")
        return _train_one(rank, name, ckpt_dir, references[name])
    return _each_architecture(names, train)


def _train_one(rank: int, name: str, ckpt_dir: str, reference: Dict[str, Any]
               ) -> Dict[str, Any]:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    # the wrapper is imported here, as in tests/support/parity.py, so that the test process
    # (which only launches and reads files) never registers its torch.xla device module
    from xla_fsdp import FSDP, ScannedLayers
    from xla_fsdp.checkpoint import save_sharded

    arch = ARCHITECTURES[name]
    device = torch_xla.device()
    world = xr.world_size()

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={arch.block})
    model = build(name)
    if arch.scan:
        owner, attr = arch.scan.rsplit(".", 1)
        owner = model.get_submodule(owner)
        setattr(owner, attr, ScannedLayers(getattr(owner, attr)))
    sharded = FSDP(model, auto_wrap_policy=policy, vocab_parallel=arch.vocab_parallel)
    opt = optimizer(sharded)

    losses, routing = [], []
    for step in range(STEPS):
        batch = arch.batch(name, step)
        local = {k: v.to(device) for k, v in rank_slice(batch, rank, world).items()}
        opt.zero_grad()
        loss = loss_of(arch, sharded, local)
        loss.backward()
        opt.step()
        losses.append(xm.all_reduce(xm.REDUCE_SUM, loss.detach(), scale=1.0 / world))
        if not arch.hf:
            routing.append(_routing(sharded))
        torch_xla.sync()

    out: Dict[str, Any] = {"losses": torch.stack(losses).cpu().tolist(),
                           "plain_losses": reference["plain_losses"]}
    if routing:
        out["routing"] = torch.stack(routing).cpu()  # (steps, layers, experts), this slice

    plain_sd = reference["plain_sd"]
    full_sd = sharded.full_state_dict(rank0_only=False)
    # each rank compares its own gathered model with the reference
    out["diffs"] = {k: (full_sd[k].double() - v.double()).abs().max().item()
                    for k, v in plain_sd.items() if k in full_sd}
    out["missing"] = sorted(set(plain_sd) - set(full_sd))

    prefix = f"{ckpt_dir}/{name}"
    save_sharded(prefix, sharded, opt)
    out["ckpt_prefix"] = prefix
    if rank == 0:
        out["full_sd"] = full_sd
        out["plain_sd"] = plain_sd
    return out
