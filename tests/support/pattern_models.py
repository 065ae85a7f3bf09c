"""Small models for the forward/backward patterns of ``pattern_scenarios.py``."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .models import CLASSES, DIM, VOCAB, Block, Carrier, Net, Stack


# -- models ---------------------------------------------------------------------------------
class ScaledBlock(Block):
    """Takes a parameter of its parent as an extra input."""

    def forward(self, x, scale):
        return x * scale + self.down(F.gelu(self.up(self.norm(x))))


class ScaledNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))
        self.b1, self.b2 = ScaledBlock(), Block()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return self.head(self.b2(self.b1(self.inp(x), self.scale)))


class PenalisedBlock(Block):
    """Adds a penalty over its own parameters, listed in its forward, and casts its input to
    their dtype."""

    def forward(self, x):
        x = x.to(next(self.parameters()).dtype)
        penalty = sum(p.pow(2).sum() for p in self.parameters())
        return super().forward(x) + 1e-2 * penalty


class PenalisedNet(Net):
    def __init__(self):
        super().__init__()
        self.b1, self.b2 = PenalisedBlock(), PenalisedBlock()


@dataclass
class BlockOutput:
    hidden: torch.Tensor
    pre_activation: torch.Tensor


class DataclassBlock(Block):
    def forward(self, x):
        pre = self.up(self.norm(x))
        return BlockOutput(x + self.down(F.gelu(pre)), pre)


class CarrierBlock(Block):
    def forward(self, x):
        return Carrier(super().forward(x))


class BuriedBlock(Block):
    """Returns its output two objects deep, where FSDP does not look."""

    def forward(self, x):
        return Carrier(Carrier(super().forward(x)))


class BuriedNet(Net):
    def __init__(self):
        super().__init__()
        self.b1 = BuriedBlock()

    def forward(self, x):
        return self.head(self.b2(self.b1(self.inp(x)).hidden.hidden))


class DataclassNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.b1, self.b2 = DataclassBlock(), CarrierBlock()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        first = self.b1(self.inp(x))
        hidden = self.b2(first.hidden).hidden
        # the second field reaches the loss too, so its gradient path matters
        return self.head(hidden) + 0.1 * first.pre_activation.mean(-1, keepdim=True)


class RotaryBlock(Block):
    """A derived constant kept as a non-persistent buffer, as rotary embeddings do."""

    def __init__(self):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):
        return super().forward(x * torch.cos(torch.cat([self.inv_freq, self.inv_freq])))


class BufferNet(Net):
    def __init__(self):
        super().__init__()
        self.b1 = RotaryBlock()


class SkipNet(nn.Module):
    """``extra`` runs a variable number of times per forward (0 = its output not needed).
    One block only: each number of calls is a step graph of its own."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.b1 = Block()
        self.extra = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x, extra_calls=1):
        h = self.b1(self.inp(x))
        for _ in range(extra_calls):
            h = h + self.extra(h)
        return self.head(h)


class SharedLayerNet(Stack):
    """One block registered twice and run twice, as ALBERT shares its layers."""

    def __init__(self):
        super().__init__(layers=1)
        self.layers = nn.ModuleList([self.layers[0]] * 2)


class SharedEmbeddingLM(nn.Module):
    """One embedding under three names and tied to the head, as T5 registers it."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(VOCAB, DIM)
        self.encoder_embed = self.shared
        self.decoder_embed = self.shared
        self.b1, self.b2 = Block(), Block()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.tie()

    def tie(self):
        # moving to an XLA device makes new parameters per module and so unties
        self.head.weight = self.shared.weight

    def forward(self, tokens):
        encoded = self.b1(self.encoder_embed(tokens))
        decoded = self.decoder_embed(torch.roll(tokens, 1, dims=1)) + encoded
        return self.head(self.b2(decoded))


