"""torch_xla's documented checkpoint recipe, on xla_fsdp through patch_torch_xla(), at N=4.

Every rank saves ``{'model', 'shard_metadata', 'optimizer'}`` with ``xm.save`` and rank 0
consolidates right away with ``consolidate_sharded_model_checkpoints``, before the other
ranks have written (``xm.save`` waits for nobody since torch_xla 2.9): consolidation must
wait for them. The consolidated model and optimizer state then load into the plain model
and its SGD optimizer, and training resumed there on one device matches the sharded run
continuing, step by step. The launched function imports torch_xla's FSDP by name, so it
also proves that launch's device process is patched.
"""
import pytest
import torch

from xla_fsdp import launch

from ..support.checkpoint_workloads import LR, MOMENTUM, train
from ..support.models import Net
from ..support.parity import paired

WORLD, BEFORE, AFTER = 4, range(3), range(3, 6)


def sharded(rank, prefix):
    import glob
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import (XlaFullyShardedDataParallel as FSDP,
                                            consolidate_sharded_model_checkpoints)
    torch.manual_seed(0)
    model = Net()
    model.b1, model.b2 = FSDP(model.b1), FSDP(model.b2, flatten_parameters=True)
    model = FSDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    world = xr.world_size()
    train(model, opt, BEFORE, rank, world)
    ckpt = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata(),
            "optimizer": opt.state_dict()}
    xm.save(ckpt, f"{prefix}_rank-{rank:08d}-of-{world:08d}.pth", master_only=False)
    out = {"fsdp_class": f"{FSDP.__module__}.{FSDP.__name__}"}
    if rank == 0:
        out["files_when_called"] = len(glob.glob(prefix + "_rank-*-of-*.pth"))
        _, out["path"] = consolidate_sharded_model_checkpoints(prefix, "_rank-*-of-*.pth")
    out["losses"] = train(model, opt, AFTER, rank, world)
    return out


def resumed(rank, path):
    import torch_xla
    saved = torch.load(path, weights_only=True)
    model = Net()
    model.load_state_dict(saved["model"], strict=True)
    model = model.to(torch_xla.device())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    opt.load_state_dict(saved["optimizer"])
    return train(model, opt, AFTER, rank, 1)


@pytest.mark.slow
def test_recipe_save_consolidate_resume(tmp_path, patched_here):
    results = launch(sharded, (str(tmp_path / "ckpt"),), num_devices=WORLD)
    assert {r["fsdp_class"] for r in results.values()} == {
        "xla_fsdp.fully_sharded.XlaFullyShardedDataParallel"}
    assert results[0]["files_when_called"] < WORLD  # rank 0 really was early
    plain = launch(resumed, (results[0]["path"],), num_devices=1)[0]
    for step, (a, b) in paired(results[0]["losses"], plain):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
