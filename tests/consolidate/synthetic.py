"""Per-rank checkpoint files written without XLA, shaped like save_sharded's, for fast tests."""
import torch

from xla_fsdp.checkpoint import sharded_checkpoint_path
from xla_fsdp.shard_layout import FlatLayout, InterleavedLayout
from xla_fsdp.shard_metadata import wrapping_fingerprint

SEP = "_FSDP_SHARD_SEPARATOR_"
SHAPES = {"lin.weight": (5, 3), "lin.bias": (5,)}


def shard_key(name):
    return ("_fsdp_shard._fsdp_wrapped_module." + name).replace(".", SEP)


def full_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def write_set(prefix, world, full=None, save_index=1, flattened=False, recipe=False,
              update_count=0, ranks=None, param_groups=None):
    """Writes ``world`` rank files of ``full`` (a {name: tensor} dict); returns their paths.
    ``flattened``: both parameters in one interleaved group, as flatten_parameters=True.
    ``recipe``: as torch_xla's documented recipe writes them (``model``, ``shard_metadata``,
    ``optimizer``; no xla_fsdp record). ``ranks``: write only these ranks' files.
    ``param_groups``: the optimizer's groups of indices (default one group of all)."""
    full = full or full_model()
    if flattened:
        return _write_flattened(prefix, world, full, save_index)
    metadata = {
        "shard_info": {"": {shard_key(n): {"_orig_size": torch.Size(s),
                                           "_orig_name": "_fsdp_wrapped_module." + n}
                            for n, s in SHAPES.items()}},
        "flatten_info": {}, "buffer_info": {}, "shared_info": {},
        "layout_info": {"": {shard_key(n): {"kind": "flat", "multiple": 1} for n in SHAPES}},
        "param_order": list(SHAPES), "update_count": update_count, "world_size": world,
        "rank": 0}
    groups = param_groups or [list(range(len(SHAPES)))]
    paths = []
    for rank in (range(world) if ranks is None else ranks):
        model, state = {}, {}
        for i, (name, shape) in enumerate(SHAPES.items()):
            layout = FlatLayout((torch.Size(shape),), world)
            model[shard_key(name)] = layout.shard([full[name]], rank)
            state[i] = {"momentum_buffer": layout.shard([full[name] * 0.5], rank),
                        "step": torch.tensor(7.0)}  # not sharded: the same on every rank
        md = dict(metadata, rank=rank)
        tree = {"model": model, "shard_metadata": md,
                "optimizer": {"state": state,
                              "param_groups": [{"lr": 0.1, "params": g} for g in groups]}}
        if not recipe:
            tree["xla_fsdp"] = {"format": 1, "world_size": world, "rank": rank,
                                "fingerprint": wrapping_fingerprint(md),
                                "save_index": save_index,
                                "optimizer_param_keys": [shard_key(n) for n in SHAPES]}
        path = sharded_checkpoint_path(prefix, rank, world)
        torch.save(tree, path)
        paths.append(path)
    return paths


def _write_flattened(prefix, world, full, save_index):
    key = shard_key("flat_param_0")
    names = list(SHAPES)
    layout = InterleavedLayout(tuple(torch.Size(s) for s in SHAPES.values()), world)
    metadata = {
        "shard_info": {"": {key: {"_orig_size": torch.Size([layout.numel]),
                                  "_orig_name": "_fsdp_wrapped_module.flat_param_0"}}},
        "flatten_info": {}, "buffer_info": {}, "shared_info": {},
        "interleave_info": {"_fsdp_wrapped_module.flat_param_0":
                            (names, [list(s) for s in SHAPES.values()], list(layout.numels))},
        "layout_info": {"": {key: {"kind": "interleaved", "multiple": 1}}},
        "param_order": names, "world_size": world, "rank": 0}
    paths = []
    for rank in range(world):
        md = dict(metadata, rank=rank)
        tree = {"model": {key: layout.shard([full[n] for n in names], rank)},
                "shard_metadata": md,
                "optimizer": {"state": {0: {"momentum_buffer": layout.shard(
                    [full[n] * 0.5 for n in names], rank), "step": torch.tensor(7.0)}},
                    "param_groups": [{"lr": 0.1, "params": [0]}]},
                "xla_fsdp": {"format": 1, "world_size": world, "rank": rank,
                             "fingerprint": wrapping_fingerprint(md), "save_index": save_index,
                             "optimizer_param_keys": [key]}}
        path = sharded_checkpoint_path(prefix, rank, world)
        torch.save(tree, path)
        paths.append(path)
    return paths
