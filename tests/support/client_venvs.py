"""Virtual environments with another major version of a client library, for the suite to run
the same client tests against it (``tests/compat/test_transformers_5.py``).

Each shares this interpreter's packages (torch, torch_xla, accelerate, peft, this project as
installed) and adds only its own version of the client on top. The suite's main environment
holds transformers 4 (``setup.py``'s test extra); ``transformers-5`` holds the newest 5.x.

``python -m tests.support.client_venvs`` builds them (CI does, before the tests); building
again keeps a venv that already has a matching version.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

VENVS: Dict[str, str] = {"transformers-5": "transformers>=5,<6"}
ROOT = Path(os.environ.get("XLA_FSDP_CLIENT_VENVS",
                           Path.home() / ".cache" / "xla_fsdp" / "client-venvs"))


def python(name: str) -> Path:
    """The interpreter of venv ``name``; an error that says how to build it if it is not."""
    path = ROOT / name / "bin" / "python"
    if not path.exists():
        raise FileNotFoundError(
            f"no {name} environment at {ROOT / name}: build it with "
            f"`python -m tests.support.client_venvs` (CI does, before the tests)")
    return path


def version(name: str, package: str) -> str:
    done = subprocess.run([str(python(name)), "-c",
                           f"import {package}; print({package}.__version__)"],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def build(name: str, quiet: bool = False) -> None:
    requirement = VENVS[name]
    package, _, bound = requirement.partition(">=")
    major = bound.split(",")[0].split(".")[0]
    target = ROOT / name
    if (target / "bin" / "python").exists() and version(name, package).split(".")[0] == major:
        return
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(target)],
                   check=True)
    subprocess.run([str(target / "bin" / "python"), "-m", "pip", "install",
                    *(["-q"] if quiet else []), requirement], check=True)


def main() -> None:
    for name in VENVS:
        build(name, quiet="--quiet" in sys.argv)
        print(f"{name}: {ROOT / name} ({version(name, VENVS[name].partition('>=')[0])})")


if __name__ == "__main__":
    main()
