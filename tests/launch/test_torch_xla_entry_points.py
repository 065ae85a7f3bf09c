"""``python -m xla_fsdp.launch script.py``: a script written for torch_xla, which imports
torch_xla's FSDP at its top and starts its ranks with ``xmp.spawn`` or ``torch_xla.launch``,
runs unchanged on virtual devices and on our FSDP, and trains like the unsharded model."""
import os
import re
import subprocess
import sys

import pytest
import torch

from xla_fsdp.launch.__main__ import main
from ..support.checks import every

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support",
                      "torch_xla_launch_script.py")


def _ranks(*args):
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    env["XLA_FSDP_NUM_DEVICES"] = "2"   # the world torch_xla.launch gets
    done = subprocess.run([sys.executable, "-m", "xla_fsdp.launch", SCRIPT, *args],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "Defaulting to PJRT_DEVICE" not in done.stderr
    return sorted(re.findall(r"rank (\d) of (\d) \((.*?)\): (\S+) ([\d.]+)", done.stdout))


def _unsharded_losses():
    """Each half of the batch's loss at the second step, trained on the whole batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.linspace(-1, 1, 32).reshape(8, 4)
    y = x.sum(1, keepdim=True)
    for _ in range(2):
        out = model(x)
        halves = [torch.nn.functional.mse_loss(out[i:i + 4], y[i:i + 4]) for i in (0, 4)]
        opt.zero_grad()
        torch.nn.functional.mse_loss(out, y).backward()
        opt.step()
    return [h.item() for h in halves]


@pytest.mark.slow
def test_torch_xla_launchers_run_scripts_unchanged():
    want = _unsharded_losses()
    for args, index in ((("spawn", "2"), None), (("launch",), "from torch_xla.launch")):
        ranks = _ranks(*args)
        assert [(r, w) for r, w, *_ in ranks] == [("0", "2"), ("1", "2")], ranks
        assert every(module == "xla_fsdp.fully_sharded" for *_, module, _ in ranks), ranks
        assert [i for _, _, i, _, _ in ranks] == [index or "0", index or "1"]
        got = [float(loss) for *_, loss in ranks]
        assert got == pytest.approx(want, rel=1e-5), (args, got, want)


def test_what_it_refuses():
    with pytest.raises(SystemExit, match="no such script: missing.py"):
        main(["missing.py"])
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
