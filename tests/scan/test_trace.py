"""One layer traced into forward and backward graphs (no XLA)."""
import torch

from xla_fsdp.scan.trace import trace_layer


def test_values_computed_from_weights_alone_are_recomputed_not_saved():
    """See [Note: what the scan saves for backward]: ``w * 2`` is weight-sized; saving it
    would stack every layer's weights in the forward loop."""
    x, w = torch.randn(3, 16), torch.randn(16, 16)
    graphs = trace_layer(lambda x, w: x @ (w * 2), [x, w], [True, True], weights={1})
    (returned,) = [n.args[0] for n in graphs.forward.graph.nodes if n.op == "output"]
    stacked = [tuple(returned[1 + i].meta["val"].shape) for i in graphs.stacked_saved]
    assert (16, 16) not in stacked, stacked
    assert 1 in graphs.saved_inputs  # the weight itself, gathered again in backward
