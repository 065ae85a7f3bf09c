"""The package's words: every cited ``[Note: ...]`` exists once, and the glossary's terms
(ARCHITECTURE.md) mean one thing in code: "group" is always qualified, "reshard" is only
freeing full parameters. Read from the package's source, as ``test_layering`` reads it."""
import ast
import re
from collections import defaultdict
from typing import Dict, Iterator, List, Tuple

from .test_layering import MODULES, PACKAGE, ROOT, Module, _where


NOTE = re.compile(r"\[Note:\s*([^\]]+?)\s*\]", re.S)


def _notes() -> Tuple[Dict[str, List[str]], List[Tuple[str, str]]]:
    """({title: where defined}, [(title, where cited)]). A citation is preceded by "see"."""
    defined: Dict[str, List[str]] = defaultdict(list)
    cited = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        text = path.read_text()
        for match in NOTE.finditer(text):
            title = " ".join(w for w in match.group(1).replace("#", " ").split())
            before = " ".join(text[max(0, match.start() - 12):match.start()]
                              .replace("#", " ").split())
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            if before.lower().endswith("see"):
                cited.append((title, where))
            else:
                defined[title].append(where)
    return defined, cited


def test_every_cited_note_exists_once():
    defined, cited = _notes()
    problems = [f"{where}: cites [Note: {title}], which no Note has as its title"
                for title, where in cited if title not in defined]
    problems += [f"[Note: {title}] is defined {len(wheres)} times: {wheres}"
                 for title, wheres in defined.items() if len(wheres) > 1]
    assert not problems, "\n".join(problems)


# -- glossary ---------------------------------------------------------------------------------
# "group" alone could be a shard group, a list of ranks, a module group or an optimizer's
# param group; these are torch_xla's or torch's own parameter names, kept as they are
GROUP_WORD = re.compile(r"^_*groups?(_|$)")
EXTERNAL_GROUP_NAMES = {
    ("xla_fsdp.unit_module", "groups"),            # clip_grad_norm_(..., groups=None)
    ("xla_fsdp.compat.torch_xla_fsdp.utils", "groups"),  # torch_xla's dummy collectives
    ("xla_fsdp.launch.virtual.sync_points", "groups"),   # xm.all_gather(..., groups=None)
}


def _bound_names(module: Module) -> Iterator[Tuple[str, int]]:
    for node in ast.walk(module.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            yield (node.id if isinstance(node, ast.Name) else node.attr), node.lineno
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id, node.lineno


def test_glossary_group_is_always_qualified():
    problems = [f"{_where(m, line)}: '{word}'" for name, m in MODULES.items()
                for word, line in _bound_names(m)
                if GROUP_WORD.match(word) and (name, word) not in EXTERNAL_GROUP_NAMES]
    assert not problems, ("'group' alone is ambiguous: say shard_group, rank_groups, "
                          "module_group or param_group\n" + "\n".join(problems))


def test_glossary_reshard_means_freeing_full_parameters():
    """Checkpoint code rewrites a checkpoint for another number of ranks; only the CLI's
    ``--reshard N`` flag keeps that name, as users know it."""
    problems = [f"{_where(m, line)}: '{word}'" for name, m in MODULES.items()
                if name.startswith("xla_fsdp.checkpoint")
                for word, line in _bound_names(m) if "reshard" in word.lower()]
    assert not problems, "\n".join(problems)
