"""Per-rank checkpoint files written without XLA, shaped like save_sharded's, for fast tests."""
import math
import zipfile

import torch

from xla_fsdp._sharding.layout import Dim0Layout, FlatLayout, InterleavedLayout
from xla_fsdp.checkpoint.formats.per_rank import sharded_checkpoint_path, wrapping_fingerprint

SEP = "_FSDP_SHARD_SEPARATOR_"
SHAPES = {"lin.weight": (5, 3), "lin.bias": (5,)}


def shard_key(name):
    return ("_fsdp_shard._fsdp_wrapped_module." + name).replace(".", SEP)


def full_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def flat_metadata(world, update_count=0):
    """Rank 0's shard metadata of ``SHAPES``, each parameter a flat group of its own."""
    return {
        "shard_info": {"": {shard_key(n): {"_orig_size": torch.Size(s),
                                           "_orig_name": "_fsdp_wrapped_module." + n}
                            for n, s in SHAPES.items()}},
        "flatten_info": {}, "buffer_info": {}, "shared_info": {},
        "layout_info": {"": {shard_key(n): {"kind": "flat", "multiple": 1} for n in SHAPES}},
        "param_order": list(SHAPES), "update_count": update_count, "world_size": world,
        "rank": 0}


def write_set(prefix, world, full=None, save_index=1, flattened=False, recipe=False,
              update_count=0, ranks=None, param_groups=None, sharding_group=None):
    """Writes ``world`` rank files of ``full`` (a {name: tensor} dict); returns their paths.
    ``flattened``: both parameters in one interleaved group, as flatten_parameters=True.
    ``recipe``: as torch_xla's documented recipe writes them (``model``, ``shard_metadata``,
    ``optimizer``; no xla_fsdp record). ``ranks``: write only these ranks' files.
    ``param_groups``: the optimizer's groups of indices (default one group of all).
    ``sharding_group``: (index, replica) of the writers' sharding group, in the metadata."""
    full = full or full_model()
    if flattened:
        return _write_flattened(prefix, world, full, save_index)
    metadata = flat_metadata(world, update_count)
    if sharding_group is not None:
        metadata["sharding_group"], metadata["replica"] = sharding_group
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


# Scanned layers: a unit at STACK_PATH holding LAYERS copies of these parameters as stacked
# shards, beside an ordinary root unit holding ROOT_SHAPES. Sizes are odd so that every
# layer layout pads at world size 3.
STACK_PATH = "_fsdp_wrapped_module.model.layers"
LAYERS = 3
LAYER_SHAPES = {"attn.weight": (5, 3), "attn.bias": (5,), "mlp.weight": (7, 5)}
ROOT_SHAPES = {"embed.weight": (4, 3)}


def stacked_names(layers=LAYERS):
    """The unwrapped model's parameter names, in parameters() order."""
    return list(ROOT_SHAPES) + [f"model.layers.{i}.{n}" for i in range(layers)
                                for n in LAYER_SHAPES]


def stacked_full_model(seed=0, layers=LAYERS):
    g = torch.Generator().manual_seed(seed)
    shapes = {**ROOT_SHAPES, **{f"model.layers.{i}.{n}": s for i in range(layers)
                                for n, s in LAYER_SHAPES.items()}}
    return {n: torch.randn(shapes[n], generator=g) for n in stacked_names(layers)}


def _stacked_groups(layer_kind, multiple):
    """(path, shard name, orig name, member names, layer kind) per group, as a scanned unit
    would register them: one flattened group (interleaved), or one group per parameter."""
    root = [("", shard_key(n), "_fsdp_wrapped_module." + n, [n], None) for n in ROOT_SHAPES]
    if layer_kind == "interleaved":
        return root + [(STACK_PATH, "_fsdp_shard_flat_param_0", "flat_param_0",
                        list(LAYER_SHAPES), layer_kind)]
    # a flat layer may also hold several parameters end to end (torch_xla-style flattening)
    if layer_kind == "flat_multi":
        return root + [(STACK_PATH, "_fsdp_shard_flat_param_0", "flat_param_0",
                        list(LAYER_SHAPES), "flat")]
    return root + [(STACK_PATH, "_fsdp_shard" + SEP + n.replace(".", SEP), n, [n], layer_kind)
                   for n in LAYER_SHAPES]


def _layer_layout(kind, members, world, multiple):
    shapes = tuple(torch.Size(LAYER_SHAPES[n]) for n in members)
    if kind == "dim0":
        return Dim0Layout(shapes[0], world)
    cls = InterleavedLayout if kind == "interleaved" else FlatLayout
    return cls(shapes, world, multiple)


def write_stacked(prefix, world, layer_kind, multiple=1, full=None, layers=LAYERS,
                  save_index=1):
    """Writes ``world`` rank files of a model with scanned layers whose stacked groups have
    layers of ``layer_kind`` ("flat", "interleaved", "dim0", or "flat_multi": one flat group
    of all of a layer's parameters); returns their paths. The optimizer is Adam-like:
    ``exp_avg`` is 0.5 x and ``exp_avg_sq`` x squared, sharded like the parameter."""
    full = full or stacked_full_model(layers=layers)
    groups = _stacked_groups(layer_kind, multiple)
    shard_info, layout_info, stack_info = {}, {}, {}
    for path, shard_name, orig, members, kind in groups:
        if kind is None:
            shard_info.setdefault(path, {})[shard_name] = {
                "_orig_size": torch.Size(ROOT_SHAPES[members[0]]), "_orig_name": orig}
            layout_info.setdefault(path, {})[shard_name] = {"kind": "flat", "multiple": 1}
            continue
        layout = _layer_layout(kind, members, world, multiple)
        one = list(layout.shapes[0]) if len(members) == 1 and kind != "interleaved" \
            else [layout.numel]
        shard_info.setdefault(path, {})[shard_name] = {
            "_orig_size": torch.Size([layers] + one), "_orig_name": orig}
        layout_info.setdefault(path, {})[shard_name] = {
            "kind": "stacked", "multiple": 1 if kind == "dim0" else multiple,
            "layers": layers, "layer_kind": kind}
        stack_info[path + "." + orig] = (list(members), [list(s) for s in layout.shapes],
                                         [math.prod(s) for s in layout.shapes])
    metadata = {"shard_info": shard_info, "flatten_info": {}, "interleave_info": {},
                "stack_info": stack_info, "buffer_info": {}, "shared_info": {},
                "layout_info": layout_info, "param_order": stacked_names(layers),
                "update_count": 0, "world_size": world, "rank": 0}
    keys = [(p + "." if p else "") + s for p, s, *_ in groups]

    def shard(group, values, rank):
        _, _, _, members, kind = group
        if kind is None:
            return FlatLayout((torch.Size(ROOT_SHAPES[members[0]]),), world).shard(
                [values[members[0]]], rank)
        layout = _layer_layout(kind, members, world, multiple)
        return torch.stack([layout.shard([values[f"model.layers.{i}.{n}"] for n in members],
                                         rank) for i in range(layers)])

    halves = {n: t * 0.5 for n, t in full.items()}
    squares = {n: t * t for n, t in full.items()}
    paths = []
    for rank in range(world):
        md = dict(metadata, rank=rank)
        state = {i: {"exp_avg": shard(g, halves, rank), "exp_avg_sq": shard(g, squares, rank),
                     "step": torch.tensor(3.0)} for i, g in enumerate(groups)}
        tree = {"model": {k: shard(g, full, rank) for k, g in zip(keys, groups, strict=True)},
                "shard_metadata": md,
                "optimizer": {"state": state,
                              "param_groups": [{"lr": 0.1, "params": list(range(len(keys)))}]},
                "xla_fsdp": {"format": 1, "world_size": world, "rank": rank,
                             "fingerprint": wrapping_fingerprint(md), "save_index": save_index,
                             "optimizer_param_keys": keys}}
        path = sharded_checkpoint_path(prefix, rank, world)
        torch.save(tree, path)
        paths.append(path)
    return paths


def flip_a_tensor_byte(path):
    """Corrupts one byte inside the largest tensor record of a ``torch.save`` file."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename),
                   key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
