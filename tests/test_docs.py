"""The README and ``docs/`` point at what exists: every relative link names a file of the
repository and, with a ``#`` part, a heading of that file (GitHub's anchors)."""
import re
from pathlib import Path

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
