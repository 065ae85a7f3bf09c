"""Run as a script: prints, as JSON, how the FSDP package that patch_torch_xla() installs
differs from the installed torch_xla's. A process of its own, since torch_xla's modules are
imported first and then replaced."""
import importlib
import inspect
import json
import re
import sys

PACKAGE = "torch_xla.distributed.fsdp"
SUBMODULES = ("", ".xla_fully_sharded_data_parallel", ".wrap", ".utils", ".state_dict_utils",
              ".consolidate_sharded_ckpts", ".xla_flatten_params_wrapper")
REQUIRED = "<required>"
# Deliberate differences, each a fix listed on xla_fsdp's XlaFullyShardedDataParallel.
ALLOWED = {
    # shards are padded to what the collectives need, not to 128 * world size elements
    ("XlaFullyShardedDataParallel.__init__", "_shard_size_multiple"),
    # None: True on a TPU, torch_xla's False elsewhere ([Note: defaults that depend on the
    # hardware])
    ("XlaFullyShardedDataParallel.__init__", "shard_param_on_dim_0"),
    ("XlaFullyShardedDataParallel.__init__", "coalesce_all_gather_ops"),
}


def public_names(module):
    names = set(getattr(module, "__all__", []))
    return names | {n for n, v in vars(module).items()
                    if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__}


def signature(value):
    if isinstance(value, property):
        return []
    try:
        return [(p.name, p.kind.name, _repr(p.default) if p.default is not p.empty else REQUIRED)
                for p in inspect.signature(value).parameters.values()]
    except (TypeError, ValueError):
        return None


def _repr(default):
    return re.sub(r" at 0x[0-9a-f]+", "", repr(default))  # functions compare by name


def compare_signatures(theirs, ours, where):
    if theirs is None:
        return []
    if ours is None:
        return [f"{where}: has no signature"]
    problems = []
    for i, (name, kind, default) in enumerate(theirs):
        if i >= len(ours) or ours[i][0] != name:
            found = ours[i][0] if i < len(ours) else "nothing"
            return problems + [f"{where}: parameter {i} is {found}, torch_xla's is {name}"]
        # a default where torch_xla requires the argument accepts every call theirs does
        if default != REQUIRED and ours[i][2] != default and (where, name) not in ALLOWED:
            problems.append(f"{where}: {name} defaults to {ours[i][2]}, torch_xla's to {default}")
        if ours[i][1] != kind:
            problems.append(f"{where}: {name} is {ours[i][1]}, torch_xla's is {kind}")
    for name, kind, default in ours[len(theirs):]:
        if default == REQUIRED and kind not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            problems.append(f"{where}: extra parameter {name} has no default")
    return problems


def compare(theirs_module, ours_module):
    problems, checked = [], 0
    for name in sorted(public_names(theirs_module)):
        checked += 1
        where = f"{theirs_module.__name__}.{name}"
        if not hasattr(ours_module, name):
            problems.append(f"{where} is missing")
            continue
        theirs, ours = getattr(theirs_module, name), getattr(ours_module, name)
        if inspect.isclass(theirs):
            for member, value in vars(theirs).items():
                if member.startswith("_") and member != "__init__":
                    continue
                checked += 1
                if not hasattr(ours, member):
                    problems.append(f"{where}.{member} is missing")
                elif callable(value) or isinstance(value, property):
                    mine = inspect.getattr_static(ours, member)
                    problems += compare_signatures(signature(value), signature(mine),
                                                   f"{name}.{member}")
        elif callable(theirs):
            problems += compare_signatures(signature(theirs), signature(ours), name)
    return problems, checked


if __name__ == "__main__":
    theirs = {s: importlib.import_module(PACKAGE + s) for s in SUBMODULES}
    for name in list(sys.modules):
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            del sys.modules[name]
    import xla_fsdp
    xla_fsdp.patch_torch_xla()
    ours = {s: importlib.import_module(PACKAGE + s) for s in SUBMODULES}
    problems, checked = [], 0
    for s in SUBMODULES:
        found, count = compare(theirs[s], ours[s])
        problems += found
        checked += count
    print(json.dumps({"checked": checked, "problems": problems,
                      "ours": {s: ours[s].__name__ for s in SUBMODULES}}))
