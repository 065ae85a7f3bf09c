"""Lightning Fabric's XLAFSDPStrategy, unchanged, on xla_fsdp through patch_torch_xla(),
at N = 2: a few steps against unsharded training, its full (consolidated) save, and its
sharded save and load.

Two things stand in for a TPU host, neither in Fabric's training or checkpoint code:
* ``XLAAccelerator`` finds no device on XLA:CPU (it asks the TPU metadata server), so its
  availability and device count are set to the virtual devices';
* ``xla_fsdp.launch`` already runs one thread per device, so the strategy gets no launcher
  of its own and ``fabric.launch()`` only sets the rank's environment up.
"""
import os

import pytest
import torch
# Lazy imports race in device threads: import what Fabric uses up front.
import lightning.fabric  # noqa: F401
from lightning.fabric import Fabric
from lightning.fabric.accelerators.xla import XLAAccelerator
from lightning.fabric.strategies import XLAFSDPStrategy
import torch_xla.distributed.parallel_loader  # noqa: F401

from xla_fsdp import launch

from ..support.checks import nonempty
from ..support.models import GLOBAL_BATCH, Block, Net, batch, loss_fn
from ..support.parity import paired

WORLD, STEPS, LR = 2, 4, 0.1


class InThreadXLAFSDPStrategy(XLAFSDPStrategy):
    def _configure_launcher(self):
        self._launcher = None  # launch() made the device threads already


def fabric_run(rank, ckpt_dir):
    from xla_fsdp import patch_torch_xla
    patch_torch_xla()
    XLAAccelerator.auto_device_count = staticmethod(lambda: WORLD)
    XLAAccelerator.is_available = staticmethod(lambda: True)
    fabric = Fabric(accelerator="tpu", devices=WORLD, strategy=InThreadXLAFSDPStrategy(
        auto_wrap_policy={Block}, activation_checkpointing_policy={Block},
        state_dict_type="full"))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    local = GLOBAL_BATCH // WORLD
    losses = []
    for step in range(STEPS):
        x, y = batch("net", step)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        loss = loss_fn("net", model(x.to(fabric.device)), y.to(fabric.device))
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=10.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    full_path = os.path.join(ckpt_dir, "full.ckpt")
    fabric.save(full_path, {"model": model, "optimizer": optimizer})
    # a filter keeps some of each rank's keys: the consolidation holds just those
    weights_path = os.path.join(ckpt_dir, "weights.ckpt")
    fabric.save(weights_path, {"model": model}, filter={"model": lambda k, _: "weight" in k})
    wrappers = {type(m).__module__ for m in model.modules()
                if type(m).__name__ == "XlaFullyShardedDataParallel"}
    fabric.strategy._state_dict_type = "sharded"  # the same strategy's sharded format
    sharded_path = os.path.join(ckpt_dir, "sharded")
    fabric.save(sharded_path, {"model": model, "optimizer": optimizer, "step": STEPS})
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(sharded_path, state)
    return {"losses": losses, "wrappers": wrappers, "step": state["step"],
            "full_path": full_path, "weights_path": weights_path,
            "units": sum(type(m).__name__ == "XlaFullyShardedDataParallel"
                         for m in model.modules())}


def unsharded(rank):
    import torch_xla
    device = torch_xla.device()
    torch.manual_seed(0)
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch("net", step)
        loss = loss_fn("net", model(x.to(device)), y.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(loss.item())
    return {"losses": losses,
            "params": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


@pytest.mark.slow
def test_fabric_xla_fsdp_strategy(tmp_path):
    ours = launch(fabric_run, (str(tmp_path),), num_devices=WORLD)[0]
    reference = launch(unsharded, num_devices=1)[0]
    assert ours["wrappers"] == {"xla_fsdp.fully_sharded"} and ours["units"] == 3
    for step, (a, b) in paired(ours["losses"], reference["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    saved = torch.load(ours["full_path"], weights_only=True)  # Fabric's consolidated file
    plain = Net()
    plain.load_state_dict(saved["model"], strict=True)
    for key, value in nonempty(reference["params"].items(), "parameters"):
        assert (plain.state_dict()[key] - value).abs().max() <= 1e-5, key
    weights = torch.load(ours["weights_path"], weights_only=True)["model"]
    assert sorted(weights) == sorted(k for k in saved["model"] if k.endswith("weight"))
    for key, value in nonempty(weights.items(), "filtered parameters"):
        assert torch.equal(value, saved["model"][key]), key
    assert ours["step"] == STEPS
