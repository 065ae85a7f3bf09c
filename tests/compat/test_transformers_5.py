"""The Trainer and PEFT tests again, on transformers 5, in the venv
``tests/support/client_venvs.py`` builds (CI builds it before the tests): the same files,
unchanged, run by that venv's interpreter. The main environment runs them on transformers 4.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..support import client_venvs

REPO = Path(__file__).resolve().parents[2]
FILES = ["tests/compat/test_hf_trainer.py", "tests/compat/test_peft.py"]


@pytest.mark.slow
def test_trainer_and_peft_tests_pass_on_transformers_5():
    interpreter = client_venvs.python("transformers-5")
    assert client_venvs.version("transformers-5", "transformers").startswith("5.")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run([str(interpreter), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *FILES], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1500)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 7 and "skipped" not in summary, summary


PATCH = "import xla_fsdp; xla_fsdp.patch_torch_xla()"
TRAINER = "from transformers import Trainer"
PROBE = "print(getattr(Trainer._wrap_model, 'xla_fsdp_keeps_wrapped_model', False))"


@pytest.mark.slow
@pytest.mark.parametrize("major", [5, 4])
def test_trainer_is_fixed_when_imported_after_the_patch_on_5_only(major):
    """[Note: Trainer's wrapped model on transformers 5]: installed when transformers.trainer
    is imported after the patch (the Trainer tests import it first: installed at once),
    never on transformers 4."""
    lines = [PATCH, TRAINER]
    interpreter = client_venvs.python("transformers-5") if major == 5 else sys.executable
    done = subprocess.run([str(interpreter), "-c", "; ".join(lines + [PROBE])],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str(major == 5), done.stdout
