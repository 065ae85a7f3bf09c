"""The benchmark's model and settings: the configuration, the GPT (the transformer block of
``examples/train_lm.py``), its batches, the wrapper options of each setting, and how each
competitor wraps the model."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.train_lm import Block  # the example's transformer block

IMPLS = ("xla_fsdp", "torch_xla")
SPMD_IMPLS = ("fsdpv2", "fsdpv2_scan")  # one SPMD process, see spmd.py
# The same model and loop with no wrapper: what tracing the model itself costs a rank, so a
# wrapper's own host time is its host time minus its baseline's. "unwrapped" runs per rank
# under ``launch`` (each rank its own full replica, no collectives); "spmd_unwrapped" in the
# SPMD process (parameters replicated, the global batch sharded along the batch).
BASELINES = ("unwrapped", "spmd_unwrapped")
BASELINE_OF = {"xla_fsdp": "unwrapped", "xla_fsdp_scanned": "unwrapped",
               "torch_xla": "unwrapped", "fsdpv2": "spmd_unwrapped",
               "fsdpv2_scan": "spmd_unwrapped"}
SPMD_PROCESS = SPMD_IMPLS + ("spmd_unwrapped",)  # what runs in the SPMD process
SPMD_SETTINGS = ("defaults",)  # FSDPv2 has none of the other settings' options
# Wrapper options, the same for both implementations. The first two are the comparison; the
# others are levers measured on their own (see benchmarks/results/levers/).
SETTINGS = {"defaults": {}, "flattened": {"flatten_parameters": True},
            "coalesced": {"coalesce_all_gather_ops": True},
            "flattened_coalesced": {"flatten_parameters": True, "coalesce_all_gather_ops": True},
            "no_barriers": {"optimization_barrier_in_forward": False,
                            "optimization_barrier_in_backward": False},
            # controls only xla_fsdp has; torch_xla runs the same options without them
            "prefetch": {"controls": ("prefetch",)},
            "grouped": {"controls": ("grouped",)}}
COMPARISON = ["defaults", "flattened"]


@dataclass(frozen=True)
class Config:
    layers: int = 8
    dim: int = 512
    heads: int = 8
    vocab: int = 8192
    seq: int = 128
    batch: int = 1           # sequences per rank
    steps: int = 8
    lr: float = 1e-4
    seed: int = 0


# -- the model ------------------------------------------------------------------------------
class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList([Block(cfg.dim, cfg.heads) for _ in range(cfg.layers)])
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.scan_layers = False  # True: torch_xla's scan_layers instead of the loop

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        if self.scan_layers:
            from torch_xla.experimental.scan_layers import scan_layers
            # pure: the layer is traced by AOTAutograd once, not again every step
            x = scan_layers(self.blocks, x, is_layer_pure=True)
        else:  # a ScannedLayers yields one callable that runs every layer
            for block in self.blocks:
                x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg: Config) -> GPT:
    torch.manual_seed(cfg.seed)
    return GPT(cfg)


def unit_sizes(cfg: Config) -> List[int]:
    """Parameter counts of the FSDP units: every block, then the root (the rest)."""
    model = build_model(cfg)
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    total = sum(p.numel() for p in model.parameters())
    return blocks + [total - sum(blocks)]


def batch(cfg: Config, rank: int, step: int) -> tuple:
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# -- wrapping -------------------------------------------------------------------------------
def wrap(model: GPT, impl: str, setting: str) -> nn.Module:
    """``impl`` "xla_fsdp_scanned": the blocks one ``ScannedLayers`` unit, then the root;
    "unwrapped": the model as it is."""
    options = dict(SETTINGS[setting])
    if impl == "unwrapped":
        import torch_xla
        return model.to(torch_xla.device())
    if impl == "xla_fsdp_scanned":
        from xla_fsdp import FSDP, ScannedLayers  # ImportError: the variant is unavailable
        options.pop("controls", None)
        model.blocks = ScannedLayers(model.blocks, **options)
        return FSDP(model, **options)
    controls = options.pop("controls", ()) if impl == "xla_fsdp" else ()
    options.pop("controls", None)
    if impl == "xla_fsdp":
        from xla_fsdp import FSDP
        from xla_fsdp.wrap import transformer_auto_wrap_policy
    else:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        options["pin_layout_in_collective_ops"] = False
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    if "grouped" in controls:
        # FSDP2's layout: the embedding its own unit, the final norm and the head one unit
        # (gathered at the end of forward and kept for backward, which starts with them),
        # so the root, which never reshards, holds only the position table
        model.embed = FSDP(model.embed, **options)
        tail = FSDP([model.ln, model.head], **options)
        tail.set_reshard_after_forward(False)
    root = FSDP(model, auto_wrap_policy=policy, **options)
    if "prefetch" in controls:  # each block's gather is issued with the previous unit's
        blocks = list(model.blocks)
        root.set_modules_to_forward_prefetch(blocks[:1])
        root.set_modules_to_backward_prefetch(blocks[-1:])
        for before, after in zip(blocks, blocks[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    return root
