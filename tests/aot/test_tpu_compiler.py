"""Finding the TPU compiler's interpreter, and saying what to do without one."""
import subprocess

import pytest

from xla_fsdp.aot import tpu_compiler


def test_without_the_compiler_the_error_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.delenv(tpu_compiler.PYTHON_ENV, raising=False)
    monkeypatch.setenv(tpu_compiler.VENV_ENV, str(tmp_path / "none"))
    monkeypatch.setattr(tpu_compiler, "_has_compiler_here", lambda: False)
    with pytest.raises(tpu_compiler.CompilerNotInstalled,
                       match=r"python -m xla_fsdp.aot install.*XLA_FSDP_TPU_PYTHON"):
        tpu_compiler.compiler_python()
    monkeypatch.setenv(tpu_compiler.PYTHON_ENV, "/opt/my/python3.12")
    assert tpu_compiler.compiler_python() == "/opt/my/python3.12"


def test_a_python_new_enough_for_jax_is_found_to_build_the_environment():
    python = tpu_compiler.find_base_python()
    out = subprocess.run([python, "-c", "import sys; print(sys.version_info >= (3, 12))"],
                         capture_output=True, text=True)
    assert out.stdout.strip() == "True"
