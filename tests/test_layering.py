"""The package's shape, checked on its source: the rules ARCHITECTURE.md states.

Pure static analysis (``ast``), no import of the package, except the last test, which imports
every module in a fresh interpreter to check that importing changes nothing process-wide.

* layers: every module belongs to a layer, and imports go down the layers only;
* no import cycles, between modules or between the packages that hold them (imports inside
  functions and under ``TYPE_CHECKING`` count);
* torch's and torch_xla's underscore APIs are used in one module only (the virtual launcher
  and the planner's traced process aside), and no module reads another module's private
  fields;
* a field of one of our classes is written only by the module that defines the class;
* no file over 600 lines; collectives issued in two modules only;
* every ``[Note: ...]`` the code cites exists, once;
* the glossary: "group" only in qualified names, "reshard" not in checkpoint code;
* only ``xla_fsdp`` is installed, and importing it installs nothing process-wide.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

from .support.checks import every

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "xla_fsdp"

# Top to bottom. A module may import modules of its own layer or of layers below it.
# An entry names a module and, with ".*", the package below it too.
LAYERS: List[Tuple[str, List[str]]] = [
    ("package root", ["xla_fsdp"]),
    ("TPU planning", ["xla_fsdp.aot.*"]),
    ("launcher", ["xla_fsdp.launch.*"]),
    ("torch_xla compatibility", ["xla_fsdp.compat.*"]),
    ("public API", ["xla_fsdp.fully_sharded", "xla_fsdp.scanned_layers", "xla_fsdp.unit_module",
                    "xla_fsdp.wrap", "xla_fsdp.activation_checkpoint"]),
    ("the consolidation tool", ["xla_fsdp.checkpoint.consolidate.*"]),
    ("checkpoints", ["xla_fsdp.checkpoint.*"]),
    ("the scan", ["xla_fsdp.scan.*"]),
    ("construction", ["xla_fsdp._init.*"]),
    ("unit", ["xla_fsdp._unit.*"]),
    ("XLA glue", ["xla_fsdp._xla.*"]),
    ("sharding", ["xla_fsdp._sharding.*"]),
]
# layers side by side rather than one above the other: the first imports nothing of the second
APART = {("checkpoints", "the scan")}
PRIVATE_API_MODULE = "xla_fsdp._xla.private_api"
VIRTUAL_LAUNCHER = "xla_fsdp.launch.virtual"
TRACED_PROCESS = "xla_fsdp.aot.traced"   # patches torch_xla's entry points in its own process
COLLECTIVES_MODULE = "xla_fsdp._sharding.collectives"
UPSTREAM = ("torch", "torch_xla", "functorch", "transformers", "accelerate", "lightning", "peft")
# names torch_xla's FSDP puts on tensors and modules, kept for the code that reads them
TORCH_XLA_ATTRIBUTES = {"_is_sharded", "_orig_size", "_orig_name", "_has_full_param",
                        "_xla_checkpointed_forward_original", "_nn_linear_forward_original"}
NAMEDTUPLE_API = {"_replace", "_fields", "_asdict", "_make"}


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    is_package: bool
    imports: List[Tuple[str, int]] = field(default_factory=list)   # (our module, line)
    upstream: Dict[str, str] = field(default_factory=dict)         # local name -> dotted origin


def _module_name(path: Path) -> Tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _installed_roots() -> Tuple[List[str], List[str]]:
    """(top-level packages, console-script targets) that setup.py installs."""
    setup = ast.parse((ROOT / "setup.py").read_text())
    includes, scripts = [], []
    for node in ast.walk(setup):
        if isinstance(node, ast.keyword) and node.arg == "include":
            includes = ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            scripts = ast.literal_eval(node.value).get("console_scripts", [])
    return sorted({p.split(".")[0] for p in includes}), scripts


ROOTS = _installed_roots()[0]


def _load_package() -> Dict[str, Module]:
    modules = {}
    for root in ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            name, is_package = _module_name(path)
            modules[name] = Module(name, path, ast.parse(path.read_text(), str(path)),
                                   is_package)
    for module in modules.values():
        _read_imports(module, modules)
    return modules


def _resolve(name: str, modules: Dict[str, Module]) -> Optional[str]:
    """The module of ours that importing ``name`` runs last (the longest existing prefix)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _read_imports(module: Module, modules: Dict[str, Module]) -> None:
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ROOTS:
                    module.imports.append((_resolve(alias.name, modules), node.lineno))
                elif alias.name.split(".")[0] in UPSTREAM:
                    local = alias.asname or alias.name.split(".")[0]
                    module.upstream[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = ".".join(p for p in (base, node.module) if p)
            else:
                base = node.module or ""
            if base.split(".")[0] in ROOTS:
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    module.imports.append((target if target in modules else _resolve(base, modules),
                                           node.lineno))
            elif base.split(".")[0] in UPSTREAM:
                for alias in node.names:
                    module.upstream[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and _called_name(node) in ("import_module", "__import__"):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                    and arg.value.split(".")[0] in ROOTS:
                module.imports.append((_resolve(arg.value, modules), node.lineno))
            elif not isinstance(arg, ast.Constant):
                module.imports.append(("<computed import>", node.lineno))


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


MODULES = _load_package()
# every rule below loops over the package's modules: none found would pass them all
assert len(MODULES) > 100, f"the package's modules were not found: {sorted(MODULES)}"


def _where(module: Module, line: int) -> str:
    return f"{module.path.relative_to(ROOT)}:{line}"


# -- layers -----------------------------------------------------------------------------------
def _layer_of(name: str) -> Optional[int]:
    best, best_len = None, -1
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            subtree = pattern.endswith(".*")
            base = pattern[:-2] if subtree else pattern
            if (name == base or subtree and name.startswith(base + ".")) and len(base) > best_len:
                best, best_len = index, len(base)
    return best


def test_every_module_has_a_layer():
    lost = sorted(n for n in MODULES if _layer_of(n) is None)
    assert not lost, f"modules in no layer of ARCHITECTURE.md: {lost}"


def test_imports_go_down_the_layers():
    problems = []
    for module in MODULES.values():
        mine = _layer_of(module.name)
        for target, line in module.imports:
            if target == "<computed import>":
                problems.append(f"{_where(module, line)}: an import whose name is computed")
                continue
            theirs = _layer_of(target)
            if mine is None or theirs is None:
                continue
            if theirs < mine or (LAYERS[mine][0], LAYERS[theirs][0]) in APART:
                problems.append(f"{_where(module, line)}: {module.name} ({LAYERS[mine][0]}) "
                                f"imports {target} ({LAYERS[theirs][0]}), a layer above it "
                                f"or beside it")
    assert not problems, "\n".join(problems)


# -- cycles -----------------------------------------------------------------------------------
def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of ``graph`` with more than one node (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    out: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(set(graph) | {n for ts in graph.values() for n in ts}):
        if node not in index:
            visit(node)
    return out


def _module_graph() -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = defaultdict(set)
    for module in MODULES.values():
        for target, _ in module.imports:
            if target in MODULES and target != module.name:
                graph[module.name].add(target)
    return graph


def test_no_import_cycle_between_modules():
    cycles = _cycles(_module_graph())
    assert not cycles, "modules that import each other, directly or not:\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_no_import_cycle_between_packages():
    """Within each package, its subpackages and modules import each other without a cycle
    (``a.x`` importing ``a.y.z`` counts as ``x`` -> ``y``)."""
    packages = [""] + [n for n, m in MODULES.items() if m.is_package]
    problems = []
    for package in packages:
        def child(name: str) -> Optional[str]:
            if not package:
                return name.split(".")[0]
            if not name.startswith(package + "."):
                return None
            return name[len(package) + 1:].split(".")[0]
        graph: Dict[str, Set[str]] = defaultdict(set)
        for a, targets in _module_graph().items():
            for b in targets:
                ca, cb = child(a), child(b)
                if ca and cb and ca != cb:
                    graph[ca].add(cb)
        for cycle in _cycles(graph):
            problems.append(f"in {package or 'the installed packages'}: "
                            + " <-> ".join(cycle))
    assert not problems, "package-level import cycles:\n" + "\n".join(problems)


# -- private APIs and private fields ----------------------------------------------------------
def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) \
        and name != "_"


def _chain(node: ast.AST) -> Optional[List[str]]:
    """``a.b.c`` as ["a", "b", "c"], or None when the root is not a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def _defined_names(module: Module) -> Set[str]:
    """Private names this module defines: functions, classes, attributes it assigns, class
    fields, and names set through ``setattr``/``__dict__``."""
    out = set()
    for node in ast.walk(module.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                    # an attribute set on anything but our own objects (``self``, ``cls``)
                    # is not defined by us: ``Trainer._wrap_model = ...`` patches theirs
                    if isinstance(sub, ast.Attribute) and (_chain(sub) or [""])[0] in (
                            "self", "cls"):
                        out.add(sub.attr)
                    elif isinstance(sub, ast.Name):
                        out.add(sub.id)
        elif isinstance(node, ast.Call) and _called_name(node) in ("setattr", "__setattr__"):
            for arg in node.args[1:2]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    out.add(arg.value)
        elif isinstance(node, ast.Subscript) and _chain(node.value) and \
                _chain(node.value)[-1] == "__dict__" and isinstance(node.slice, ast.Constant):
            out.add(node.slice.value)
    return {n for n in out if isinstance(n, str) and _is_private(n)}


def _torch_xla_bindings() -> Set[str]:
    """torch_xla's C bindings: ours only to patch (the launcher, the traced process), never
    our fields; ``_xla/private_api.py`` calls them."""
    import torch_xla
    return {n for n in dir(torch_xla._XLAC) if _is_private(n)}


OURS: Dict[str, Set[str]] = {n: _defined_names(m) for n, m in MODULES.items()}
OUR_PRIVATE = set().union(*OURS.values()) - _torch_xla_bindings()


def _private_api_uses(module: Module) -> List[str]:
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            base = node.module if isinstance(node, ast.ImportFrom) else ""
            names = [f"{base}.{a.name}" if base else a.name for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.level:
                continue
            for dotted in names:
                if dotted.split(".")[0] in UPSTREAM and any(
                        _is_private(p) for p in dotted.split(".")):
                    found.append(f"{_where(module, node.lineno)}: imports {dotted}")
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain = _chain(node)
            if chain and chain[0] in module.upstream:
                origin = module.upstream[chain[0]]
                found.append(f"{_where(module, node.lineno)}: {'.'.join(chain)} "
                             f"({origin}{'.' + '.'.join(chain[1:])})")
            elif node.attr not in OUR_PRIVATE and node.attr not in NAMEDTUPLE_API and \
                    node.attr not in TORCH_XLA_ATTRIBUTES and not _is_stdlib_root(chain, module):
                found.append(f"{_where(module, node.lineno)}: .{node.attr}, a private "
                             f"attribute none of our modules defines (upstream's)")
        elif isinstance(node, ast.Call) and _called_name(node) in ("getattr", "hasattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _is_private(node.args[1].value) \
                and node.args[1].value not in (OUR_PRIVATE | TORCH_XLA_ATTRIBUTES
                                               | NAMEDTUPLE_API):
            # the same read spelled as a string, which the attribute rule above cannot see
            found.append(f"{_where(module, node.lineno)}: {_called_name(node)}(..., "
                         f"{node.args[1].value!r}), a private attribute none of our modules "
                         f"defines (upstream's)")
    return found


def _is_stdlib_root(chain: Optional[List[str]], module: Module) -> bool:
    if not chain:
        return False
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == chain[0] and \
                        alias.name.split(".")[0] in sys.stdlib_module_names:
                    return True
    return False


def test_upstream_private_apis_in_one_module():
    problems = []
    for name, module in MODULES.items():
        if name == PRIVATE_API_MODULE or name.startswith((VIRTUAL_LAUNCHER, TRACED_PROCESS)):
            continue
        problems += _private_api_uses(module)
    assert not problems, (f"upstream private APIs outside {PRIVATE_API_MODULE}:\n"
                          + "\n".join(problems))


def test_no_private_field_read_across_modules():
    problems = []
    for name, module in MODULES.items():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) \
                    and node.attr in OUR_PRIVATE and node.attr not in OURS[name] \
                    and node.attr not in TORCH_XLA_ATTRIBUTES:
                owners = sorted(n for n, names in OURS.items() if node.attr in names)
                problems.append(f"{_where(module, node.lineno)}: .{node.attr}, private to "
                                f"{', '.join(owners)}")
    assert not problems, "\n".join(problems)


# -- one writer per field ---------------------------------------------------------------------
def _is_frozen_dataclass(cls: ast.ClassDef) -> bool:
    return any(isinstance(d, ast.Call) and (_chain(d.func) or [""])[-1] == "dataclass"
               and any(k.arg == "frozen" and getattr(k.value, "value", False) for k in d.keywords)
               for d in cls.decorator_list)


def _class_fields(module: Module) -> Set[str]:
    out = set()
    for cls in (n for n in ast.walk(module.tree) if isinstance(n, ast.ClassDef)):
        if _is_frozen_dataclass(cls):
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
            for t in _store_targets(node):
                if isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.add(t.attr)
    return out


def _store_targets(node: ast.AST) -> Iterator[ast.Attribute]:
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    else:
        return
    for t in targets:
        for sub in ast.walk(t):
            if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                yield sub


def test_fields_have_one_writer():
    fields = {name: _class_fields(m) for name, m in MODULES.items()}
    problems = []
    for name, module in MODULES.items():
        for node in ast.walk(module.tree):
            for t in _store_targets(node):
                if isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                    continue
                if t.attr in fields[name]:
                    continue
                owners = sorted(n for n, f in fields.items() if t.attr in f)
                if owners:
                    problems.append(f"{_where(module, node.lineno)}: writes .{t.attr}, a field "
                                    f"of a class in {', '.join(owners)}")
    assert not problems, "\n".join(problems)


# -- size, collectives, Notes -----------------------------------------------------------------
def _tracked_python_files() -> List[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    files = [ROOT / p for p in out.stdout.split()] if out.returncode == 0 else []
    return files or sorted(ROOT.rglob("*.py"))


def test_no_file_over_600_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _tracked_python_files()
            if p.exists() and (n := len(p.read_text().splitlines())) > 600]
    assert not long, "\n".join(long)


COLLECTIVE_CALLS = {"all_gather", "all_reduce", "reduce_scatter", "all_to_all",
                    "collective_permute", "optimization_barrier_", "send", "recv"}
# every rank meeting on the host, outside any graph: only the checkpoints' coordination
MEETINGS = {"rendezvous", "xla_rendezvous", "mesh_reduce"}
COORDINATION_MODULE = "xla_fsdp.checkpoint.coordination"
# torch_xla's native collectives and torch's functional ones, below ``xm``'s functions
BINDINGS = re.compile(r"_xla_(all_gather|all_reduce|reduce_scatter|all_to_all"
                      r"|collective_permute)\w*|_c10d_functional")


def _binding_wrappers() -> Set[str]:
    """The functions of ``private_api`` that issue a binding themselves: read from its code,
    so that a wrapper added under a new name is held to the rule too."""
    tree = MODULES[PRIVATE_API_MODULE].tree
    return {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
            and any(isinstance(a, ast.Attribute) and BINDINGS.fullmatch(a.attr)
                    for a in ast.walk(f))}


def _issued(module: Module, node: ast.AST) -> Tuple[Set[str], Optional[List[str]]]:
    """(upstream collective or meeting names ``node`` reaches, as ``xm.all_gather`` or
    ``from torch_xla.core.xla_model import all_gather`` does; its attribute chain)."""
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UPSTREAM:
        return {a.name for a in node.names} & (COLLECTIVE_CALLS | MEETINGS), None
    chain = _chain(node) if isinstance(node, ast.Attribute) else None
    if chain and chain[0] in module.upstream and node.attr in COLLECTIVE_CALLS | MEETINGS:
        return {node.attr}, chain
    return set(), chain


def test_collectives_are_issued_in_two_modules_through_bindings_held_in_one():
    """``xm``'s collectives and barriers only in ``_sharding/collectives.py``, its host-side
    meetings (``rendezvous``) only in ``checkpoint/coordination.py``; the private bindings only
    in ``_xla/private_api.py``, whose wrappers of them only that module and
    ``_xla/traced_collectives.py`` (the collectives Dynamo traces) call. Whether reached as
    attributes or imported by name."""
    callers = {COLLECTIVES_MODULE, "xla_fsdp._xla.traced_collectives", PRIVATE_API_MODULE}
    wrappers = _binding_wrappers()
    assert {"pinned_all_gathers", "functional_all_gather"} <= wrappers
    problems = []
    for name, module in MODULES.items():
        if name.startswith((VIRTUAL_LAUNCHER, TRACED_PROCESS)):
            continue  # they stand in for the collectives (see their modules)
        for node in ast.walk(module.tree):
            issued, chain = _issued(module, node)
            wrong = {c for c in issued if c in COLLECTIVE_CALLS and name != COLLECTIVES_MODULE
                     or c in MEETINGS and name != COORDINATION_MODULE}
            if wrong or chain and BINDINGS.fullmatch(node.attr) and name != PRIVATE_API_MODULE:
                problems.append(f"{_where(module, node.lineno)}: {wrong or '.'.join(chain)}")
            used = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else \
                [node.attr] if isinstance(node, ast.Attribute) else []
            if name not in callers and wrappers.intersection(used):
                problems.append(f"{_where(module, node.lineno)}: {wrappers.intersection(used)}")
    assert not problems, "\n".join(problems)


def test_sharding_layer_is_pure():
    """``_sharding`` holds arithmetic on tensors and the collectives: no modules, no hooks, and
    torch_xla only in its collectives module."""
    problems = []
    for name, module in MODULES.items():
        if not name.startswith("xla_fsdp._sharding"):
            continue
        for origin in module.upstream.values():
            if origin.startswith("torch_xla") and name != COLLECTIVES_MODULE:
                problems.append(f"{module.path.name}: imports {origin}")
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("register_") \
                    and "hook" in node.attr:
                problems.append(f"{_where(module, node.lineno)}: {node.attr}")
            if isinstance(node, ast.ClassDef) and any(
                    (_chain(b) or [""])[-1] == "Module" for b in node.bases):
                problems.append(f"{_where(module, node.lineno)}: class {node.name} is a Module")
    assert not problems, "\n".join(problems)


# -- what is installed, and what importing does -----------------------------------------------
def test_only_xla_fsdp_is_installed():
    roots, scripts = _installed_roots()
    assert roots == [PACKAGE], f"setup.py installs the top-level packages {roots}"
    assert every(s.split("=")[1].strip().startswith(PACKAGE + ".") for s in scripts), scripts


IMPORT_EVERYTHING = """
import importlib, json, os, sys
import torch
import torch_xla, torch_xla.core.xla_model, torch_xla.runtime  # set variables of their own
before = dict(os.environ)
for name in sys.argv[1:]:
    importlib.import_module(name)
from torch.optim import optimizer
print(json.dumps({
    "torch.xla": hasattr(torch, "xla"),
    "optimizer hooks": len(optimizer._global_optimizer_pre_hooks)
                       + len(optimizer._global_optimizer_post_hooks),
    "environment": sorted(k for k in set(os.environ) | set(before)
                          if os.environ.get(k) != before.get(k)),
}))
"""


def test_importing_changes_nothing_process_wide():
    """Process-wide effects (the ``torch.xla`` device module, optimizer step hooks,
    ``ACCELERATE_USE_FSDP``) are installed when the first unit is built, never at import."""
    names = sorted(n for n in MODULES if not n.startswith(VIRTUAL_LAUNCHER)
                   and not n.endswith("__main__"))
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("ACCELERATE_USE_FSDP", None)
    out = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING, *names], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    effects = json.loads(out.stdout.strip().splitlines()[-1])
    assert effects == {"torch.xla": False, "optimizer hooks": 0, "environment": []}, effects
