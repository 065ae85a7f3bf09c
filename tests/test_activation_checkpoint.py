"""``checkpoint_module``: the recompute's optimization barrier holds the module's weights and
buffers, as torch_xla's holds them (its ``test_operations.py::test_opt_barrier`` counts
them in the HLO), on a plain module and inside an FSDP unit, where the weights are the
unit's full parameters (see [Note: the recompute's barrier holds the module's weights])."""
import torch
import torch.nn as nn

from xla_fsdp import launch

from .support.hlo import traced_hlo


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.x = nn.Linear(128, 128)
        self.register_buffer("buffer", torch.zeros(64, 64))
        self.dropout = nn.Dropout(p=0.1)

    def forward(self, inp):
        return self.dropout(self.x(inp))


def _barrier_after_backward(model, grads_of, device):
    inp = torch.randn(128, 128, requires_grad=True).to(device)
    model(inp).sum().backward()
    return [line for line in traced_hlo(grads_of()).splitlines() if " opt-barrier(" in line]


def barriers(rank):
    import torch_xla
    from xla_fsdp import FSDP, checkpoint_module
    device = torch_xla.device()
    torch.manual_seed(0)
    plain = checkpoint_module(WithBuffer().to(device))
    out = {"plain": _barrier_after_backward(plain, lambda: [plain.x.weight.grad], device)}
    torch_xla.sync()
    unit = FSDP(checkpoint_module(WithBuffer()), optimization_barrier_in_backward=False)
    out["in_unit"] = _barrier_after_backward(
        unit, lambda: [p.grad for p in unit.parameters()], device)
    torch_xla.sync()
    return out


def test_the_recompute_barrier_holds_weights_and_buffers():
    out = launch(barriers, num_devices=1)[0]
    # each barrier operand appears twice on its line: in the result type and as an operand
    (only,) = out["plain"]
    counts = {shape: only.count(shape) for shape in ("f32[128,128]", "f32[128]", "f32[64,64]")}
    # the saved input, the incoming gradient and the weight; the bias; the buffer
    assert counts == {"f32[128,128]": 6, "f32[128]": 2, "f32[64,64]": 2}, out["plain"]
    # inside a unit (whose own barriers hold its shards and gathered values): the recompute's
    # barrier, the one that holds the buffer, holds the full weight and bias (placeholders)
    (recompute,) = [line for line in out["in_unit"] if "f32[64,64]" in line]
    counts = {shape: recompute.count(shape) for shape in ("f32[128,128]", "f32[128]",
                                                           "f32[64,64]")}
    assert counts == {"f32[128,128]": 6, "f32[128]": 2, "f32[64,64]": 2}, out["in_unit"]
