"""The suite's own rule: a check cannot pass on nothing (``tests/support/checks.py``).

In an assertion, ``all()`` of an empty input is True and ``zip`` stops at its shorter input;
so is a loop over ``zip`` whose body asserts. Each must be ``every``, ``pairs`` or
``zip(..., strict=True)``."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _lax_zip(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "zip" and not any(k.arg == "strict" for k in node.keywords))


def _lax_checks(path: Path, root: Path = TESTS.parent):
    where = path.relative_to(root)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assert):
            for call in ast.walk(node.test):
                if _lax_zip(call) or (isinstance(call, ast.Call) and isinstance(
                        call.func, ast.Name) and call.func.id == "all"):
                    yield f"{where}:{call.lineno}"
        elif isinstance(node, ast.For) and _lax_zip(node.iter) and any(
                isinstance(n, ast.Assert) for statement in node.body for n in ast.walk(statement)):
            yield f"{where}:{node.iter.lineno}"


def test_no_assertion_passes_on_an_empty_or_shorter_input():
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 100, "the suite's files were not found"
    lax = [where for path in files for where in _lax_checks(path)]
    assert lax == [], f"all() or zip() in a check: use every, pairs or strict=True at {lax}"


def test_the_rule_sees_each_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("assert all(x)\nassert every(a for a, b in zip(p, q))\n"
                      "for a, b in zip(p, q):\n    assert a\n"
                      "for a, b in zip(p, q, strict=True):\n    assert a\n"
                      "assert every(x) and list(zip(p, q, strict=True))\n")
    assert [w.split(":")[1] for w in _lax_checks(sample, tmp_path)] == ["1", "2", "3"]
