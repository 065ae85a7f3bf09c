"""patch_torch_xla(): torch_xla's FSDP surface, its modules, and the refusals. Each check
runs in a fresh interpreter, since patching changes sys.modules for good."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ..support.synthetic_checkpoints import SHAPES, full_model, write_set
from ..support.checks import every

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support",
                     "surface_probe.py")
ENV = dict(os.environ, PJRT_DEVICE="CPU")


def _python(code, *args):
    return subprocess.run([sys.executable, "-c", code, *args], env=ENV, capture_output=True,
                          text=True, timeout=300)


def test_every_name_and_signature_of_torch_xla_fsdp():
    run = subprocess.run([sys.executable, PROBE], env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["problems"] == []
    assert report["checked"] >= 80  # torch_xla 2.9 has 83 public names and members
    assert every(name.startswith(("xla_fsdp.", "torch_xla.distributed.fsdp.consolidate"))
                 for name in report["ours"].values()), report["ours"]


@pytest.mark.slow
def test_patch_is_idempotent_and_python_m_consolidates(tmp_path):
    prefix = str(tmp_path / "ckpt")
    write_set(prefix, 2, recipe=True)
    code = (
        "import runpy, sys, xla_fsdp\n"
        "xla_fsdp.patch_torch_xla(); xla_fsdp.patch_torch_xla()\n"
        "import torch_xla.distributed.fsdp as f, torch_xla.distributed as d\n"
        "assert d.fsdp is f and f.__name__ == 'xla_fsdp.compat.torch_xla_fsdp', f\n"
        "sys.argv = ['consolidate_sharded_ckpts', '--ckpt_prefix', sys.argv[1]]\n"
        "runpy.run_module('torch_xla.distributed.fsdp.consolidate_sharded_ckpts',\n"
        "                 run_name='__main__')\n")
    for _ in range(2):  # torch_xla's default '*.pth' also matches the output of the first run
        run = _python(code, prefix)
        assert "verified" in run.stdout, run.stdout + run.stderr[-3000:]
    saved = torch.load(prefix + "_consolidated.pth", weights_only=True)
    assert every(torch.equal(saved["model"][n], full_model()[n]) for n in SHAPES)


@pytest.mark.slow
def test_refuses_after_torch_xla_fsdp_wrapped_a_module():
    code = (
        "import importlib, torch, xla_fsdp\n"
        "real = importlib.import_module(\n"
        "    'torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel')\n"
        "unit = real.XlaFullyShardedDataParallel(torch.nn.Linear(4, 4))\n"
        "try:\n"
        "    xla_fsdp.patch_torch_xla()\n"
        "except RuntimeError as exc:\n"
        "    print('refused:', exc)\n")
    run = _python(code)
    assert "refused: patch_torch_xla(): torch_xla's own FSDP has already wrapped ['Linear']" \
        in run.stdout, run.stdout + run.stderr[-3000:]


@pytest.mark.slow
def test_refuses_when_a_module_holds_torch_xla_fsdp():
    code = (
        "import xla_fsdp\n"
        "from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel\n"
        "try:\n"
        "    xla_fsdp.patch_torch_xla()\n"
        "except RuntimeError as exc:\n"
        "    print('refused:', exc)\n")
    run = _python(code)
    assert "refused: patch_torch_xla(): __main__ imported torch_xla's" in run.stdout, \
        run.stdout + run.stderr[-3000:]


@pytest.mark.slow
def test_accelerate_is_told_from_a_backward_to_the_step():
    """[Note: telling accelerate the gradients are sharded]: set between an FSDP backward and
    the next optimizer step only, so that a model trained later without FSDP gets
    accelerate's all-reduce; a value the user set stays."""
    code = ("import os, torch, torch_xla, warnings, xla_fsdp\n"
            "def told(when): print(when, os.environ.get('ACCELERATE_USE_FSDP'))\n"
            "xla_fsdp.patch_torch_xla()\n"
            "told('after patch:')\n"
            "model = xla_fsdp.FSDP(torch.nn.Linear(4, 4))\n"
            "told('after a unit:')\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "model(torch.ones(2, 4, device=torch_xla.device())).sum().backward()\n"
            "told('after a backward:')\n"
            "opt.step()\n"
            "told('after the step:')\n")
    clean = {k: v for k, v in ENV.items() if k != "ACCELERATE_USE_FSDP"}
    # unset and set to false, in two interpreters side by side
    unset, false = [subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                    for env in (clean, dict(clean, ACCELERATE_USE_FSDP="false"))]
    out, err = unset.communicate(timeout=300)
    assert "after patch: None\nafter a unit: None\nafter a backward: true\n" \
        "after the step: None" in out, out + err[-3000:]
    out, err = false.communicate(timeout=300)
    assert "after a backward: false\nafter the step: false" in out, out + err[-3000:]
    assert "ACCELERATE_USE_FSDP=false" in err
