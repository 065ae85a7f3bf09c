"""The suite's small models, their data and their loss.

``Net`` and its blocks are what most tests wrap; ``Stack`` is the shape ``ScannedLayers``
takes; ``MemStack`` is the scanned-layer tests' larger stack. Sizes divide
neither by the world size nor by 128, so padding is always exercised.
"""
import torch
import torch.nn as nn

# six steps: the graphs settle by step 2 and three steady steps follow, so every
# setting is seen through several optimizer updates on cached graphs
STEPS = 6
GLOBAL_BATCH = 16
DIM, HIDDEN, CLASSES, VOCAB = 32, 70, 5, 50  # 70 and 5 divide neither by N nor by 128


class Block(nn.Module):
    def __init__(self, dim=DIM, hidden=HIDDEN):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, batchnorm=False):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM) if batchnorm else nn.Identity()
        self.b1, self.b2 = Block(), Block()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return self.head(self.b2(self.b1(self.bn(self.inp(x)))))


def checkpoint_forward(module):
    """Runs ``module``'s forward under ``torch.utils.checkpoint``, reentrant, as Hugging
    Face's gradient checkpointing does inside each layer."""
    from types import MethodType
    from torch.utils.checkpoint import checkpoint
    original = module.forward
    module.forward = MethodType(lambda self, x: checkpoint(original, x, use_reentrant=True),
                                module)
    return module


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.b1, self.b2 = Block(), Block()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.b2(self.b1(self.emb(tokens))))


class AttentionBlock(Block):
    """Causal self-attention, then the block's MLP. The attention is torch's
    ``scaled_dot_product_attention`` as Hugging Face's sdpa path calls it, or (``eager``) its
    eager path: scores, ``softmax(dtype=torch.float32)`` and a cast back."""
    def __init__(self, eager=False, heads=2):
        super().__init__()
        self.eager, self.heads = eager, heads
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.eager:
            scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            probs = nn.functional.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1,
                                          dtype=torch.float32).to(q.dtype)
            h = probs @ v
        else:
            h = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return super().forward(x + self.out(h.transpose(1, 2).reshape(b, t, d)))


class AttentionLM(TiedLM):
    """``TiedLM`` whose blocks attend: one through sdpa, one through the eager path. Its
    embedding starts small, so that logits start near zero and SGD at the suite's rate
    trains it smoothly enough to compare bf16 with float32 step by step."""
    def __init__(self):
        super().__init__()
        self.b1, self.b2 = AttentionBlock(), AttentionBlock(eager=True)
        nn.init.normal_(self.emb.weight, std=0.1)


TIED_KINDS = ("tied", "attention")  # token models whose head is the embedding


class MaskedBlock(Block):
    """A block that reads booleans, as attention does: a boolean buffer, and a causal mask
    built inside the layer, which its backward reads again."""
    def __init__(self):
        super().__init__()
        self.register_buffer("keep", torch.arange(HIDDEN) % 3 != 0)

    def forward(self, x):
        h = self.up(self.norm(x)).masked_fill(~self.keep, 0.0)
        causal = torch.ones(HIDDEN, HIDDEN, dtype=torch.bool, device=x.device).tril()
        scores = (h.unsqueeze(-1) * h.unsqueeze(-2)).masked_fill(~causal, float("-inf"))
        h = (scores.softmax(-1) @ h.unsqueeze(-1)).squeeze(-1)
        return x + self.down(torch.nn.functional.gelu(h))


class Stack(nn.Module):
    """Identical blocks in a ModuleList, run by a Python loop: the shape ScannedLayers takes."""
    def __init__(self, layers=3, block=Block):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([block() for _ in range(layers)])
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def forward_in(model, x, dtype=None):
    """``model(x)`` unsharded, computing as a unit with ``compute_dtype=dtype`` does: from
    ``dtype`` copies of the float32 parameters and floating inputs, the gradients reaching
    the float32 masters through the casts; BatchNorm in float32, its input cast up and its
    output down. The reference of the low-precision settings whose models hold no attention
    (which a unit computes its own way)."""
    if dtype in (None, torch.float32):
        return model(x)
    batch_norms = [m for m in model.modules() if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d,
                                                            nn.BatchNorm3d))]
    kept = {id(p) for m in batch_norms for p in m.parameters()}
    params = {k: p if id(p) in kept else p.to(dtype) for k, p in model.named_parameters()}
    hooks = [h for m in batch_norms for h in (
        m.register_forward_pre_hook(lambda _m, args: tuple(a.float() for a in args)),
        m.register_forward_hook(lambda _m, _args, out: out.to(dtype)))]
    try:
        return torch.func.functional_call(model, params, (x.to(dtype) if x.is_floating_point()
                                                          else x,))
    finally:
        for h in hooks:
            h.remove()


def build_model(kind):
    if kind.startswith("stack"):
        return Stack(block=MaskedBlock if kind == "stack_masked" else Block)
    if kind == "attention":
        return AttentionLM()
    return TiedLM() if kind == "tied" else Net(batchnorm=(kind == "bn"))


def batch(kind, step):
    g = torch.Generator().manual_seed(10_000 + step)
    if kind in TIED_KINDS:
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, 6), generator=g)
        return tokens, torch.roll(tokens, -1, dims=1)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
    teacher = torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(1))
    return x, (x @ teacher).argmax(-1)


def loss_fn(kind, out, target):
    if kind in TIED_KINDS:
        return nn.functional.cross_entropy(out.reshape(-1, VOCAB).float(), target.reshape(-1))
    return nn.functional.cross_entropy(out.float(), target)


# -- the scanned-layer tests' blocks ------------------------------------------------------------
MEM_DIM, MEM_HIDDEN, MEM_LAYERS = 256, 1024, 8  # weights dominate: 2 * 256 * 1024 per layer


class MemStack(nn.Module):
    def __init__(self, layers=MEM_LAYERS, dim=MEM_DIM, hidden=MEM_HIDDEN):
        super().__init__()
        self.layers = nn.ModuleList([Block(dim, hidden) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class ScaledByDepth(Block):
    """Reads its ``layer_idx``, as GPT-2's attention does under
    ``scale_attn_by_inverse_layer_idx``."""
    def forward(self, x):
        return super().forward(x) / (self.layer_idx + 1)


def indexed(cls, layers=4):
    """``layers`` blocks of ``cls`` (8 -> 12 -> 8) whose ``layer_idx`` differ, as Hugging
    Face's decoder layers' do."""
    stack = [cls(8, 12) for _ in range(layers)]
    for i, layer in enumerate(stack):
        layer.layer_idx = i
    return stack


class Carrier:
    """A plain object holding a tensor, as some libraries return."""

    def __init__(self, hidden):
        self.hidden = hidden
