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


HOLDER = """
import sys, time
from jax.experimental import topologies
topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
print("holding", flush=True)
time.sleep(float(sys.argv[1]))
"""
TINY = """HloModule tiny, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %a = f32[8]{0} add(f32[8]{0} %p, f32[8]{0} %p)
}
"""


def test_a_plan_compiles_beside_a_process_holding_libtpu(monkeypatch):
    """A JAX process that took libtpu's machine-wide lock (as one started without
    ALLOW_MULTIPLE_LIBTPU_LOAD does) does not stop a plan, even when the caller's own
    environment says not to share: a compile-only client uses no device."""
    import os
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS",
                                                            "ALLOW_MULTIPLE_LIBTPU_LOAD")}
    holder = subprocess.Popen([tpu_compiler.compiler_python(), "-c", HOLDER, "120"],
                              env=dict(env, TPU_SKIP_MDS_QUERY="1"), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "0")
        compiled = tpu_compiler.compile_programs("v5e:2x2", [tpu_compiler.Program(TINY, 1)])
        assert compiled.programs[0].status == "ok", compiled.programs[0].message
        assert len(compiled.coords) == 4
    finally:
        holder.kill()
        holder.wait()
