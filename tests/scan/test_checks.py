"""What a scanned stack refuses before it runs (no XLA: layers traced on fake tensors)."""
import pytest
import torch
import torch.nn as nn

from xla_fsdp.scan.checks import (check_identical, forward_graph, refuse_input_mutation,
                                  refuse_varying_computation, varying_attributes)
from xla_fsdp.scanned_layers import IGNORED_ATTRIBUTES

from ..support.models import Block, ScaledByDepth, indexed


def _check(layers):
    check_identical(layers, IGNORED_ATTRIBUTES)


def test_layers_must_be_identical():
    _check([Block(8, 12), Block(8, 12)])
    with pytest.raises(ValueError, match=r"layer 1 differs from layer 0 at 'down.in_features'"):
        _check([Block(8, 12), Block(8, 16)])
    odd = Block(8, 12)
    odd.up.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="layer 1 differs"):
        _check([Block(8, 12), odd])
    other = Block(8, 12)
    other.norm.eps = 1e-3
    with pytest.raises(ValueError, match=r"'norm.eps'"):
        _check([Block(8, 12), other])
    indexed = [Block(8, 12), Block(8, 12)]
    for i, layer in enumerate(indexed):
        layer.layer_idx = i  # Hugging Face's cache index may differ
    _check(indexed)


def test_what_a_scan_cannot_run_is_refused():
    shared = Block(8, 12)
    with pytest.raises(ValueError, match="share a parameter"):
        _check([shared, shared])
    with_bn = [nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(2)]
    with pytest.raises(ValueError, match="running statistics"):
        _check(with_bn)
    hooked = [Block(8, 12), Block(8, 12)]
    hooked[0].up.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="module hooks"):
        _check(hooked)


def test_a_differing_attribute_the_computation_reads_is_refused():
    """See [Note: attributes that differ between layers]."""
    x = torch.randn(2, 8)
    for cls, reads in ((Block, False), (ScaledByDepth, True)):
        layers = indexed(cls)
        varying = varying_attributes(layers, IGNORED_ATTRIBUTES)
        assert varying == [("", "layer_idx", [0, 1, 2, 3])]
        check = lambda: refuse_varying_computation(
            layers[0], [x], layers[0], varying, forward_graph(layers[0], [x]).code)
        if reads:
            with pytest.raises(ValueError, match=r"'layer_idx' \(layer 0: 0, layer 1: 1\)"):
                check()
        else:
            check()
        assert layers[0].layer_idx == 0  # put back


class Counting(Block):
    """Counts its calls in a buffer, which a loop slice cannot write back."""
    def __init__(self):
        super().__init__(8, 12)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return super().forward(x)


def test_a_layer_writing_to_an_input_is_refused():
    layer = Counting()

    def run(x, calls):
        layer._buffers["calls"] = calls
        return layer(x)
    graph = forward_graph(run, [torch.randn(2, 8), torch.zeros(())])
    with pytest.raises(ValueError, match=r"writes in place to buffer 'calls' \(aten.add_"):
        refuse_input_mutation(graph, ["the hidden state", "buffer 'calls'"])

    def in_place_on_a_view(x):
        x[:, :2].mul_(2)  # through a view of the hidden state
        return x
    graph = forward_graph(in_place_on_a_view, [torch.randn(2, 8)])
    with pytest.raises(ValueError, match="the hidden state"):
        refuse_input_mutation(graph, ["the hidden state"])
    refuse_input_mutation(forward_graph(Block(8, 12), [torch.randn(2, 8)]),
                          ["the hidden state"])  # temporaries written in place are fine
