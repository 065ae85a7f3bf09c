"""The README and ``docs/`` say what is true: every relative link names a file of the
repository and, with a ``#`` part, a heading of that file (GitHub's anchors); every command
block marked ``<!-- runnable -->`` runs, in a directory holding the checkpoint the docs
name (``ckpt/step100``, saved at N = 4), and writes the files its ``# ->`` comments name."""
import glob
import re
import subprocess
from pathlib import Path

import pytest

from xla_fsdp import launch

from .support.checkpoint_workloads import optimizer_for, train, wrapped_net
from .support.checks import nonempty

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(page: Path) -> set:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in text.splitlines() if line.startswith("#")}


def _links(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)
            if not m.group(1).startswith(("http://", "https://", "mailto:"))]


def test_every_relative_link_reaches_a_file_and_heading():
    broken = []
    for page in PAGES:
        for link in _links(page):
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert _links(PAGES[0]), "the README links to nothing"
    assert not broken, "\n".join(broken)


def test_the_readme_stays_a_first_read():
    # reference material belongs in docs/ (options, benchmarks, the launcher's internals)
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines"
    assert not [line for line in lines if re.search(r"\bissue \d+", line)]


def save_the_docs_checkpoint(rank, prefix):
    import torch_xla.runtime as xr

    from xla_fsdp.checkpoint import save_sharded
    model = wrapped_net()
    opt = optimizer_for(model)
    train(model, opt, range(2), rank, xr.world_size())
    save_sharded(prefix, model, opt, extra={"step": 100})


def _runnable_blocks():
    return [(page.relative_to(ROOT), block) for page in PAGES for block in
            re.findall(r"<!-- runnable -->\n```bash\n(.*?)```", page.read_text(), re.S)]


@pytest.mark.slow
def test_the_marked_command_blocks_run_and_write_what_they_say(tmp_path):
    blocks = _runnable_blocks()
    assert blocks, "no command block is marked runnable"
    launch(save_the_docs_checkpoint, (str(tmp_path / "ckpt" / "step100"),), num_devices=4)
    for page, block in nonempty(blocks, "command blocks marked runnable"):
        for line in nonempty(filter(str.strip, block.splitlines()), f"commands in {page}"):
            command, _, comment = line.partition("#")
            done = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True,
                                  text=True, timeout=600)
            assert done.returncode == 0, f"{page}: {command}\n{done.stderr[-2000:]}"
            claimed = re.search(r"-> (\S+)", comment)
            if claimed:
                assert glob.glob(str(tmp_path / claimed.group(1).rstrip("/"))), \
                    f"{page}: {command} wrote no {claimed.group(1)}"
