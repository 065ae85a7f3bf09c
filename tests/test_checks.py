"""The suite's own rule: a check cannot pass on nothing (``tests/support/checks.py``).

In an assertion, ``all()`` of an empty input is True: it must be ``every``. Anywhere in the
suite, ``zip`` stops at its shorter input, so a check over its pairs (in an assertion, a loop
that asserts, or a list checked later) misses what one side lacks: it must be ``pairs`` or
``zip(..., strict=True)``, but for a sequence and its own tail (``zip(a, a[1:])``)."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _lax_zip(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "zip" and not any(k.arg == "strict" for k in node.keywords))


def _pairs_with_own_tail(node: ast.Call) -> bool:
    """``zip(a, a[1:])``: neighbours, one shorter by design."""
    return len(node.args) == 2 and isinstance(node.args[1], ast.Subscript) \
        and ast.dump(node.args[1].value) == ast.dump(node.args[0])


def _lax_checks(path: Path, root: Path = TESTS.parent):
    where = path.relative_to(root)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assert):
            for call in ast.walk(node.test):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) \
                        and call.func.id == "all":
                    yield f"{where}:{call.lineno}"
        # anywhere else too: a list built over a zip and checked later (``same_state`` of
        # each pair, losses compared step by step) loses what the shorter side lacks
        if _lax_zip(node) and not _pairs_with_own_tail(node) and path.name != "checks.py":
            yield f"{where}:{node.lineno}"


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
                      "assert every(x) and list(zip(p, q, strict=True))\n"
                      "same = [a == b for a, b in zip(p, q)]\n"
                      "steps = [b - a for a, b in zip(p, p[1:])]\n")
    assert sorted(int(w.split(":")[1]) for w in _lax_checks(sample, tmp_path)) == [1, 2, 3, 8]
