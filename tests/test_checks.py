"""The suite's own rule: a check cannot pass on nothing (``tests/support/checks.py``).

In an assertion, ``all()`` of an empty input is True: it must be ``every``. Anywhere in the
suite, ``zip`` stops at its shorter input, so a check over its pairs (in an assertion, a loop
that asserts, or a list checked later) misses what one side lacks: it must be ``pairs`` or
``zip(..., strict=True)``, but for a sequence and its own tail (``zip(a, a[1:])``).

A ``for`` loop whose body checks (an ``assert``, a call named ``assert...`` such as
``assert_close``, or ``pytest.raises``; in the body or in a block within it, not in a
function defined there) checks nothing over an empty collection: its iterable must be one that cannot
be empty. That is ``nonempty(...)``, ``pairs(...)`` or ``paired(...)`` (``parity.py``), either
of the first two in ``enumerate``, a literal with an element, a ``range`` of literal bounds
that holds a number, or ``zip(..., strict=True)`` whose first input is one of these. A name
is not: the rule does not follow what was asserted of it before the loop."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _call_to(node: ast.AST, *names: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
        and node.func.id in names


def _lax_zip(node: ast.AST) -> bool:
    return _call_to(node, "zip") and not any(k.arg == "strict" for k in node.keywords)


def _pairs_with_own_tail(node: ast.Call) -> bool:
    """``zip(a, a[1:])``: neighbours, one shorter by design."""
    return len(node.args) == 2 and isinstance(node.args[1], ast.Subscript) \
        and ast.dump(node.args[1].value) == ast.dump(node.args[0])


def _is_check(node: ast.AST) -> bool:
    """An ``assert``, or a call that checks: ``assert_close`` and the like (any function or
    method named ``assert...``), ``pytest.raises``."""
    if isinstance(node, ast.Assert):
        return True
    if not isinstance(node, ast.Call):
        return False
    name = node.func.id if isinstance(node.func, ast.Name) else \
        node.func.attr if isinstance(node.func, ast.Attribute) else ""
    return name.startswith("assert") or name == "raises"


def _asserts(body) -> bool:
    """Whether the statements check when they run (``_is_check``): not in a function they
    define, which checks when it is called, if ever."""
    todo = list(body)
    while todo:
        node = todo.pop()
        if _is_check(node):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend(ast.iter_child_nodes(node))
    return False


def _int(node: ast.AST):
    return node.value if isinstance(node, ast.Constant) and type(node.value) is int else None


def _holds_some(node: ast.AST) -> bool:
    """Whether the iterable is known, from its form alone, to hold a value."""
    if _call_to(node, "nonempty", "pairs", "paired"):
        return True
    if _call_to(node, "enumerate"):
        return bool(node.args) and _call_to(node.args[0], "nonempty", "pairs")
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        # ``[*a]`` is as empty as ``a``
        return any(not isinstance(e, ast.Starred) for e in node.elts)
    if isinstance(node, ast.Dict):
        return any(k is not None for k in node.keys)  # None: ``{**a}``
    if _call_to(node, "range"):
        bounds = [_int(a) for a in node.args]
        if len(bounds) == 1:
            return bounds[0] is not None and bounds[0] >= 1
        return len(bounds) == 2 and None not in bounds and bounds[1] > bounds[0]
    if _call_to(node, "zip"):
        # strict: every input is as long as the first
        return bool(node.args) and _holds_some(node.args[0]) and any(
            k.arg == "strict" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in node.keywords)
    return False


def _lax_checks(path: Path, root: Path = TESTS.parent):
    where = path.relative_to(root)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assert):
            for call in ast.walk(node.test):
                if _call_to(call, "all"):
                    yield f"{where}:{call.lineno}"
        # anywhere else too: a list built over a zip and checked later (``same_state`` of
        # each pair, losses compared step by step) loses what the shorter side lacks
        if _lax_zip(node) and not _pairs_with_own_tail(node) and path.name != "checks.py":
            yield f"{where}:{node.lineno}"
        if isinstance(node, ast.For) and _asserts(node.body) and not _holds_some(node.iter):
            yield f"{where}:{node.lineno}"


def test_no_assertion_passes_on_an_empty_or_shorter_input():
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 100, "the suite's files were not found"
    lax = [where for path in files for where in _lax_checks(path)]
    assert lax == [], ("all(), zip() or a loop that asserts over what may be empty in a check: "
                       f"use every, pairs, nonempty or strict=True at {lax}")


# each line the rule must report ends in "# lax"
SAMPLE = """\
assert all(x)  # lax
assert every(a for a, b in zip(p, q))  # lax
for a, b in zip(p, q):  # lax
    assert a
for a, b in zip(p, q, strict=True):  # lax
    assert a
assert every(x) and list(zip(p, q, strict=True))
same = [a == b for a, b in zip(p, q)]  # lax
steps = [b - a for a, b in zip(p, p[1:])]
for k, v in d.items():  # lax
    assert v
for x in xs:  # lax
    if x:
        with c:
            for y in [x]:
                assert y
for i, x in enumerate(xs):  # lax
    assert x
for x in [*xs]:  # lax
    assert x
for x in xs:  # lax
    torch.testing.assert_close(x, y)
for x in xs:  # lax
    assert_same_tree(x, y)
for x in xs:  # lax
    with pytest.raises(ValueError):
        f(x)
for x in xs:
    print(x)
for x in {**d}:  # lax
    assert x
for x in ():  # lax
    assert x
for x in range(n):  # lax
    assert x
for x in range(0):  # lax
    assert x
for x in range(2, 2):  # lax
    assert x
for x in zip(nonempty(p), q):  # lax
    assert x
for k, v in nonempty(d.items(), "entries"):
    assert v
for i, (a, b) in enumerate(pairs(p, q)):
    assert a
for step, (a, b) in paired(p, q):
    assert a
for a, b in zip(nonempty(p), q, strict=True):
    assert a
for x in (1, [*xs]):
    assert x
for x in {"a": 1, **d}:
    assert x
for x in range(1):
    assert x
for x in sorted(nonempty(xs)):  # lax
    assert x
for x in range(1, 3):
    assert x
for x in xs:
    def check():
        assert x
for x in xs:
    seen.append(x)
"""


def test_the_rule_sees_each_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(SAMPLE)
    lax = [n for n, line in enumerate(SAMPLE.splitlines(), 1) if line.endswith("# lax")]
    # a loop over a lax zip is reported for both: lines count once
    assert sorted({int(w.split(":")[1]) for w in _lax_checks(sample, tmp_path)}) == lax
