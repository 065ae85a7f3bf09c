"""The TPU compiler, in an interpreter of its own: finding it, installing it, calling it.

libtpu's compile-only client comes with ``jax[tpu]``, whose current releases need Python
3.12 or later, while this package runs wherever torch_xla 2.9 does (3.10 to 3.13). So the
compiler lives in a virtual environment of its own, created by ``install()`` (``python -m
xla_fsdp.aot install``), and runs as a child process (``libtpu_worker.py``) that reads HLO
text from files and writes what libtpu says back as JSON. The two processes share no
library, so neither torch's nor jax's version constrains the other's.

Which interpreter: ``XLA_FSDP_TPU_PYTHON`` if set, else the environment ``install()`` made
(``XLA_FSDP_TPU_VENV``, default ``~/.cache/xla_fsdp/tpu-compiler``).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

# jax and the libtpu it pins, as checked: libtpu 0.0.50.1 compiles torch_xla 2.9's HLO
JAX_REQUIREMENT = "jax[tpu]==0.12.0.1"
PYTHON_ENV = "XLA_FSDP_TPU_PYTHON"
VENV_ENV = "XLA_FSDP_TPU_VENV"
_WORKER = Path(__file__).with_name("libtpu_worker.py")
_MIN_PYTHON = (3, 12)


class CompilerNotInstalled(RuntimeError):
    """No interpreter with the TPU compiler was found."""


@dataclass
class Program:
    """One HLO module to compile: ``replicas`` x ``partitions`` chips take part."""
    hlo_text: str
    replicas: int
    partitions: int = 1


@dataclass
class Compiled:
    """What libtpu said of one program. ``status``: "ok", "oom" (the compiler refused it for
    lack of HBM) or "error"."""
    status: str
    message: str
    memory: dict
    cost: dict
    optimized_hlo: str
    oom: dict
    compile_seconds: float


def venv_path() -> Path:
    return Path(os.environ.get(VENV_ENV, "~/.cache/xla_fsdp/tpu-compiler")).expanduser()


def compiler_python() -> str:
    """The interpreter that has the TPU compiler; CompilerNotInstalled says how to get one."""
    configured = os.environ.get(PYTHON_ENV)
    if configured:
        return configured
    candidate = venv_path() / "bin" / "python"
    if candidate.exists():
        return str(candidate)
    if _has_compiler_here():
        return sys.executable
    raise CompilerNotInstalled(
        f"the TPU compiler (libtpu, from {JAX_REQUIREMENT}, which needs Python >= 3.12) is not "
        f"installed: run `python -m xla_fsdp.aot install` once (it creates {venv_path()}), or "
        f"set {PYTHON_ENV} to a Python that has it")


def _has_compiler_here() -> bool:
    """Whether this interpreter has it (``pip install 'xla_fsdp[tpu]'`` on Python >= 3.12)."""
    import importlib.util
    return sys.version_info[:2] >= _MIN_PYTHON and all(
        importlib.util.find_spec(m) is not None for m in ("jax", "libtpu"))


def _python_version(python: str) -> Optional[tuple]:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return tuple(int(x) for x in out.stdout.split()) if out.returncode == 0 else None


def find_base_python() -> str:
    """A Python >= 3.12 to build the compiler's environment from: this one if it is new
    enough, else ``python3.12``/``python3.13``/``python3.14`` on the PATH or under pyenv."""
    if sys.version_info[:2] >= _MIN_PYTHON:
        return sys.executable
    names = ["python3.12", "python3.13", "python3.14"]
    candidates = [p for p in (shutil.which(n) for n in names) if p]
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for version in ("3.12", "3.13", "3.14"):
        candidates += sorted(glob.glob(os.path.join(pyenv_root, "versions", f"{version}*",
                                                    "bin", "python" + version)))
    candidates += [f"/usr/bin/{n}" for n in names] + [f"/usr/local/bin/{n}" for n in names]
    for candidate in candidates:
        version = _python_version(candidate)
        if version is not None and version >= _MIN_PYTHON:
            return candidate
    raise CompilerNotInstalled(
        f"the TPU compiler needs Python >= 3.12 ({JAX_REQUIREMENT}); none was found on the "
        f"PATH or under pyenv. Install one, or pass --python to `python -m xla_fsdp.aot "
        f"install`")


def install(venv: Optional[Path] = None, python: Optional[str] = None,
            quiet: bool = False) -> Path:
    """Creates the compiler's environment (or completes one) and checks that libtpu loads.
    Returns the environment's interpreter (this one, when it has the compiler already).

    A new environment is built beside ``venv`` and moved into place only once libtpu
    loads in it, so a failed or interrupted install leaves nothing behind; an interpreter
    older than 3.12 is refused before anything is made. Raises ``CompilerNotInstalled``
    saying what went wrong."""
    if venv is None and python is None and _has_compiler_here():
        return Path(sys.executable)
    venv = Path(venv) if venv is not None else venv_path()
    target = venv / "bin" / "python"
    if target.exists():
        _pip_install(target, quiet)
        return target
    base = python or find_base_python()
    version = _python_version(base)
    if version is None:
        raise CompilerNotInstalled(f"--python {base}: not a Python interpreter that runs here")
    if version < _MIN_PYTHON:
        raise CompilerNotInstalled(
            f"--python {base} is Python {version[0]}.{version[1]}; the TPU compiler "
            f"({JAX_REQUIREMENT}) needs Python >= 3.12")
    venv.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=venv.name + ".partial-", dir=venv.parent))
    try:
        _run([base, "-m", "venv", str(building)], "create a virtual environment")
        _pip_install(building / "bin" / "python", quiet)
        os.rename(building, venv)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def _pip_install(python: Path, quiet: bool) -> None:
    _run([str(python), "-m", "pip", "install", "--disable-pip-version-check"]
         + (["-q"] if quiet else []) + [JAX_REQUIREMENT], f"install {JAX_REQUIREMENT}",
         quiet)
    check = subprocess.run([str(python), "-c", "import jax, libtpu; print(jax.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise CompilerNotInstalled(f"{python} cannot import jax and libtpu: "
                                   f"{_tail(check.stderr, 1)}")


def _run(command: List[str], what: str, quiet: bool = True) -> None:
    """Runs ``command``; CompilerNotInstalled with its last line of output if it fails."""
    done = subprocess.run(command, capture_output=quiet, text=True)
    if done.returncode != 0:
        said = _tail((done.stderr or "") + (done.stdout or ""), 1) if quiet else \
            "(its output is above)"
        raise CompilerNotInstalled(f"could not {what} (exit code {done.returncode}): {said}")


@dataclass
class Compilation:
    """What one call to libtpu returned: the HBM the compiler lets one chip use, where
    each replica's (or partition's) chip sits in the grid, and one ``Compiled`` each."""
    usable_hbm_bytes: int
    coords: List[List[int]]
    programs: List[Compiled]


def compile_programs(topology: str, programs: Sequence[Program], *,
                     timeout: float = 3600.0) -> Compilation:
    """Compiles ``programs`` with libtpu for the slice named ``topology`` (libtpu's grid
    name).

    A program larger than the chip's HBM is refused with the compiler's figures (required,
    available) and nothing else: libtpu has no way to compile it for the slice regardless
    (``--xla_tpu_max_hbm_size_mib`` is not honoured by the compile-only client, and
    ``--xla_tpu_no_crash_on_oom`` yields "Invalid TPU program")."""
    python = compiler_python()
    with tempfile.TemporaryDirectory(prefix="xla_fsdp_tpu_") as tmp:
        request = {"topology": topology, "programs": []}
        for i, program in enumerate(programs):
            path = os.path.join(tmp, f"program_{i}.hlo.txt")
            Path(path).write_text(program.hlo_text)
            request["programs"].append({"hlo": path, "replicas": program.replicas,
                                        "partitions": program.partitions,
                                        "out_hlo": os.path.join(tmp, f"optimized_{i}.txt")})
        request_path = os.path.join(tmp, "request.json")
        response_path = os.path.join(tmp, "response.json")
        Path(request_path).write_text(json.dumps(request))
        # not PYTHONPATH (this process's packages are not the compiler's) nor XLA_FLAGS
        # (XLA:CPU's flags; libtpu takes LIBTPU_INIT_ARGS)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
        env.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server: not on a TPU VM
        # libtpu locks /tmp/libtpu_lockfile for the TPU device unless told it may share
        # the machine: a compile-only client uses no device, so it never takes the lock
        # (whatever the caller's environment says), and a plan runs beside other plans, a
        # test run or a JAX process holding the lock
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
        done = subprocess.run([python, str(_WORKER), request_path, response_path], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not os.path.exists(response_path):
            raise RuntimeError(f"the TPU compiler process ({python}) failed with exit code "
                               f"{done.returncode}:\n{_tail(done.stderr)}")
        response = json.loads(Path(response_path).read_text())
        compiled = []
        for entry, spec in zip(response["programs"], request["programs"]):
            out_hlo = Path(spec["out_hlo"])
            optimized = out_hlo.read_text() if out_hlo.exists() else ""
            compiled.append(Compiled(entry["status"], entry.get("message", ""),
                                     entry.get("memory", {}), entry.get("cost", {}), optimized,
                                     entry.get("oom", {}), entry.get("compile_seconds", 0.0)))
        return Compilation(response["usable_hbm_bytes"], response.get("coords", []), compiled)


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])
