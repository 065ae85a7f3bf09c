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
from ..support.checks import nonempty, pairs

REPO = Path(__file__).resolve().parents[2]
FILES = ["tests/compat/test_hf_trainer.py", "tests/compat/test_peft.py"]


@pytest.mark.slow
def test_trainer_and_peft_tests_pass_on_transformers_5(tmp_path):
    """Each file in an interpreter of its own, side by side: a run is mostly one busy core
    (the ranks trace in turn), so on two cores the pair takes about as long as the longer."""
    interpreter = client_venvs.python("transformers-5")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    runs = [subprocess.Popen([str(interpreter), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "--basetemp", str(tmp_path / Path(name).stem), name],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for name in FILES]
    try:
        assert client_venvs.version("transformers-5", "transformers").startswith("5.")
        passed = 0
        for name, run in pairs(FILES, runs, what="files"):
            out, err = run.communicate(timeout=1500)
            summary = out.strip().splitlines()[-1] if out.strip() else ""
            assert run.returncode == 0, name + "\n" + out[-6000:] + err[-3000:]
            count = re.search(r"(\d+) passed", summary)
            assert count and "skipped" not in summary, (name, summary)
            passed += int(count.group(1))
        assert passed >= 7, passed
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.communicate()


PATCH = "import xla_fsdp; xla_fsdp.patch_torch_xla()"
TRAINER = "from transformers import Trainer"
PROBE = "print(getattr(Trainer._wrap_model, 'xla_fsdp_keeps_wrapped_model', False))"


@pytest.mark.slow
def test_trainer_is_fixed_when_imported_after_the_patch_on_5_only():
    """[Note: Trainer's wrapped model on transformers 5]: installed when transformers.trainer
    is imported after the patch (the Trainer tests import it first: installed at once),
    never on transformers 4. One fresh interpreter per major version, side by side."""
    code = "; ".join([PATCH, TRAINER, PROBE])
    interpreters = {5: client_venvs.python("transformers-5"), 4: sys.executable}
    runs = {major: subprocess.Popen([str(interpreter), "-c", code], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=REPO)
            for major, interpreter in interpreters.items()}
    for major, run in nonempty(runs.items(), "interpreters"):
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, (major, err[-2000:])
        assert out.strip().splitlines()[-1] == str(major == 5), (major, out)
