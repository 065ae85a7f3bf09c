"""DCP round trips through every layout: a model wrapped one way is trained and saved with
``save_dcp`` (and ``save_consolidated``) at one world size (``save_all``), then loaded into
the same model wrapped another way at another world size and saved again (``load_all``). Run by
``tests/checkpoint/dcp/test_roundtrip.py``; the bad-input checks run in the loading launch.
"""
import os
import pickle
import shutil

import torch

from .checkpoint_workloads import same_state, snapshot
from .checks import every
from .models import GLOBAL_BATCH, Net, Stack, TiedLM, batch, loss_fn

SAVE_WORLD, LOAD_WORLD, STEPS = 4, 2, 2
CONSOLIDATED_FORMATS = ("pt", "safetensors")
# name: (model, wrapping at SAVE_WORLD, wrapping at LOAD_WORLD, optimizer)
CONFIGS = {
    "nested_to_flattened": ("net", "nested", "flattened", "adamw"),
    "flattened_to_dim0": ("net", "flattened", "dim0", "sgd"),
    "dim0_bf16_to_nested": ("net", "dim0_bf16", "nested", "adamw"),
    "scanned_to_layer_units": ("stack", "scanned_flat", "layer_units", "adamw"),
    "layer_units_to_scanned_dim0": ("stack", "layer_units", "scanned_dim0", "sgd"),
    "tied_to_grouped": ("tied", "nested", "tied_grouped", "adamw"),
    "frozen": ("frozen", "nested", "flattened", "adamw"),
    "empty_param": ("empty", "dim0", "flattened", "adamw"),
    # a 0-d parameter: its NAdam momentum product is one number on every rank, its moments
    # shards; the load trains a step on, where ranks holding other numbers trace apart
    "scalar_nadam": ("scalar", "nested", "nested", "nadam"),
    "hybrid_to_nested": ("net", "hybrid", "nested", "adamw"),
    "groups_to_nested": ("net", "groups", "nested", "adamw"),
}


def build(kind, seed):
    torch.manual_seed(seed)
    if kind == "stack":
        return Stack()
    if kind == "tied":
        return TiedLM()
    model = Net()
    if kind == "frozen":
        for p in model.b1.up.parameters():
            p.requires_grad_(False)
    if kind == "empty":  # a parameter of no elements: no rank holds a chunk of it
        block = model.b1
        block.empty = torch.nn.Parameter(torch.zeros(0, 4))
        forward = block.forward
        block.forward = lambda x: forward(x) + block.empty.sum()  # used, so it has state
    if kind == "scalar":
        model.scale = torch.nn.Parameter(torch.tensor(1.3))
        forward = model.forward
        model.forward = lambda x: forward(x) * model.scale
    return model


def wrap(model, how, rank):
    from xla_fsdp import FSDP, ScannedLayers
    kw = {"flatten_parameters": how == "flattened", "shard_param_on_dim_0": how.startswith("dim0")}
    if how == "dim0_bf16":
        kw.update(compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)
    if how in ("hybrid", "groups"):
        kw.update(sharding_groups=[[0, 1], [2, 3]], sharding_rank=rank % 2, sharding_world_size=2,
                  replicate_across_groups=how == "hybrid")
    if how.startswith("scanned"):
        model.layers = ScannedLayers(model.layers, flatten_parameters=how == "scanned_flat",
                                     shard_param_on_dim_0=how == "scanned_dim0")
    elif how == "layer_units":
        for i, layer in enumerate(model.layers):
            model.layers[i] = FSDP(layer, **kw)
    elif how == "tied_grouped":
        FSDP([model.emb, model.head], **kw)
        model.b1, model.b2 = FSDP(model.b1, **kw), FSDP(model.b2, **kw)
    else:
        model.b1, model.b2 = FSDP(model.b1, **kw), FSDP(model.b2, **kw)
    return FSDP(model, **kw)


def optimizer(name, model):
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if name == "nadam":
        return torch.optim.NAdam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(model, opt, kind, rank, split):
    import torch_xla
    data_kind = "tied" if kind == "tied" else "net"
    local = GLOBAL_BATCH // split
    part = rank % split
    for step in range(STEPS):
        x, y = batch(data_kind, step)
        x = x[part * local:(part + 1) * local].to(torch_xla.device())
        y = y[part * local:(part + 1) * local].to(torch_xla.device())
        opt.zero_grad()
        loss_fn(data_kind, model(x), y).backward()
        opt.step()
        torch_xla.sync()


def save_all(rank, directory):
    """Every config trained and saved at SAVE_WORLD; rank 0's full state dicts (of both
    groups for ``groups_to_nested``)."""
    import torch_xla
    from xla_fsdp.checkpoint import save_consolidated, save_dcp
    out = {}
    for i, (name, (kind, how, _, opt_name)) in enumerate(CONFIGS.items()):
        model = wrap(build(kind, 0), how, rank)
        opt = optimizer(opt_name, model)
        split = 2 if how in ("hybrid", "groups") else SAVE_WORLD
        _train(model, opt, kind, rank, split)
        save_dcp(os.path.join(directory, name), model, opt, extra={"config": name})
        save_consolidated(consolidated_path(directory, name, i), model, opt,
                          format=CONSOLIDATED_FORMATS[i % 2], extra={"config": name})
        out[name] = model.full_state_dict(rank0_only=False)
        torch_xla.sync()
    os.makedirs(directory + "_extra_state", exist_ok=True)
    save_extra_state(rank, directory + "_extra_state")
    return out


def consolidated_path(directory, name, i, sharding_group=""):
    """Where ``save_all`` writes a config's consolidated checkpoint (``.pth`` and
    ``.safetensors`` alternately), outside ``directory``."""
    ext = ".safetensors" if CONSOLIDATED_FORMATS[i % 2] == "safetensors" else ".pth"
    return os.path.join(directory + "_consolidated", name + sharding_group + ext)


def load_all(rank, directory, again):
    """Every config loaded at LOAD_WORLD into another wrapping and saved again to ``again``,
    from its DCP checkpoint and (under ``<name>_consolidated``) from its consolidated one, by
    every rank or only the first; then the bad-input checks."""
    import torch_xla
    from xla_fsdp.checkpoint import load_consolidated, load_dcp, save_dcp
    out = {}
    for i, (name, (kind, _, how, opt_name)) in enumerate(CONFIGS.items()):
        model = wrap(build(kind, 1), how, rank)
        opt = optimizer(opt_name, model)
        source = os.path.join(directory, name)
        extra = load_dcp(source + ("_group-000" if name == "groups_to_nested" else ""), model, opt)
        save_dcp(os.path.join(again, name), model, opt, extra=extra)
        out[name] = model.full_state_dict(rank0_only=False)
        if kind == "scalar":
            _train(model, opt, kind, rank, LOAD_WORLD)
        model = wrap(build(kind, 2), how, rank)
        opt = optimizer(opt_name, model)
        group = "_group-000" if name == "groups_to_nested" else ""
        extra = load_consolidated(consolidated_path(directory, name, i, group), model, opt,
                                  first_rank_reads=i % 3 == 1)
        save_dcp(os.path.join(again, name + "_consolidated"), model, opt, extra=extra)
        if kind == "scalar":
            _train(model, opt, kind, rank, LOAD_WORLD)
        torch_xla.sync()
    out["refusals"] = _refusals(rank, os.path.join(directory, "nested_to_flattened"),
                                os.path.join(again, "damaged"))
    out["extra_state"] = load_extra_state(rank, directory + "_extra_state")
    return out


class _WithExtraState(torch.nn.Linear):
    """A Linear that keeps state of its own in ``state_dict()`` (as FP8 modules do)."""
    calls = 0

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, state):
        self.calls = state["calls"]


class _WithTensorExtraState(torch.nn.Linear):
    """A Linear whose extra state is a uint8 tensor of a length that changes, as
    TransformerEngine's serialized FP8 metadata is; it keeps what a load gave it."""
    calls = 0
    given = None

    def get_extra_state(self):
        return torch.arange(self.calls, dtype=torch.uint8) * 3

    def set_extra_state(self, state):
        self.given, self.calls = state, len(state)


class _Refusing(_WithTensorExtraState):
    refuse = False

    def set_extra_state(self, state):
        if self.refuse:
            raise ValueError("this rank refuses its extra state")
        super().set_extra_state(state)


def _holding_extra_state(rank, how, module_class, calls):
    model = Net()
    model.b1.up = module_class(model.b1.up.in_features, model.b1.up.out_features)
    model = wrap(model, how, rank)
    holder = next(m for m in model.modules() if isinstance(m, module_class))
    holder.calls = calls
    return model, holder


def save_extra_state(rank, directory):
    """Tensor extra state saved every way at SAVE_WORLD: the first rank's (7 elements) is
    not the others' (5)."""
    from xla_fsdp.checkpoint import save_consolidated, save_dcp, save_sharded
    model, _ = _holding_extra_state(rank, "nested", _WithTensorExtraState, 5 if rank else 7)
    save_dcp(os.path.join(directory, "dcp"), model)
    save_consolidated(os.path.join(directory, "ck.pth"), model)
    save_consolidated(os.path.join(directory, "ck.safetensors"), model, format="safetensors")
    save_sharded(os.path.join(directory, "ck"), model)
    if rank == 0:  # an unwrapped model's state dict, its extra state an object
        unwrapped = Net()
        unwrapped.b1.up = _WithExtraState(unwrapped.b1.up.in_features,
                                          unwrapped.b1.up.out_features)
        unwrapped.b1.up.calls = 9
        torch.save(unwrapped.state_dict(), os.path.join(directory, "object.pt"))


def load_extra_state(rank, directory):
    """Each checkpoint of ``save_extra_state`` loaded at LOAD_WORLD into another wrapping:
    what ``set_extra_state`` was given; a full state dict's round trip; one lacking it."""
    from xla_fsdp import FSDP
    from xla_fsdp.checkpoint import (CheckpointError, load_consolidated, load_dcp,
                                     load_sharded, save_consolidated, save_sharded)
    out = {}
    for label, load in (("dcp", lambda m: load_dcp(os.path.join(directory, "dcp"), m)),
                        ("pt", lambda m: load_consolidated(os.path.join(directory, "ck.pth"), m)),
                        ("safetensors", lambda m: load_consolidated(
                            os.path.join(directory, "ck.safetensors"), m)),
                        ("per_rank", lambda m: load_sharded(os.path.join(directory, "ck"), m))):
        model, holder = _holding_extra_state(rank, "flattened", _WithTensorExtraState, 0)
        load(model)
        out[label] = holder.given.tolist()
    model, holder = _holding_extra_state(rank, "flattened", _WithExtraState, 0)
    load_consolidated(os.path.join(directory, "object.pt"), model)
    out["object"] = holder.calls
    model, holder = _holding_extra_state(rank, "flattened", _WithTensorExtraState, 4 + rank)
    full = model.full_state_dict(rank0_only=False)
    out["full_keys"] = [k for k in full if "extra" in k]
    fresh, again = _holding_extra_state(rank, "flattened", _WithTensorExtraState, 0)
    fresh.load_full_state_dict(full)
    out["full_state_dict"] = again.given.tolist()
    del full["b1.up._extra_state"]
    try:
        fresh.load_full_state_dict(full)
        out["strict"] = "no error"
    except CheckpointError as exc:
        out["strict"] = str(exc)
    out["non_strict"] = fresh.load_full_state_dict(full, strict=False)[0], again.calls
    # set_extra_state refusing on one rank: every rank raises, and nothing changed
    model, holder = _holding_extra_state(rank, "flattened", _Refusing, 2)
    holder.refuse = rank == 1
    before = model.full_state_dict(rank0_only=False)
    try:
        load_dcp(os.path.join(directory, "dcp"), model)
        out["refused"] = "no error"
    except CheckpointError as exc:
        out["refused"] = str(exc)
    out["refused_unchanged"] = (holder.calls, every(
        torch.equal(v, before[k]) for k, v in model.full_state_dict(rank0_only=False).items()))
    # a resume at the saving world size and wrapping (the own-file path), another length; the
    # safetensors file keeps ``extra`` without an optimizer
    save_sharded(os.path.join(directory, "own"), model)
    save_consolidated(os.path.join(directory, "own.safetensors"), model, format="safetensors",
                      extra={"step": 3})
    fresh, holder = _holding_extra_state(rank, "flattened", _WithTensorExtraState, 0)
    load_sharded(os.path.join(directory, "own"), fresh)
    out["own_file"] = holder.calls
    out["safetensors_extra"] = load_consolidated(os.path.join(directory, "own.safetensors"),
                                                 fresh)
    # a module under two names keeps its extra state under both, as state_dict() does
    shared = Net()
    shared.b1.up = _WithTensorExtraState(shared.b1.up.in_features, shared.b1.up.out_features)
    shared.alias = shared.b1.up
    out["shared_keys"] = sorted(k for k in FSDP(shared).full_state_dict(rank0_only=False)
                                if "extra" in k)
    return out


def _extra_state_refusals(rank, directory, good, out):
    """The checkpoints of the unwrapped model refuse a model whose modules keep extra state;
    the per-rank files keep it."""
    from xla_fsdp.checkpoint import (CheckpointError, load_dcp, load_sharded,
                                     save_consolidated, save_dcp, save_sharded)
    model, stateful = _holding_extra_state(rank, "nested", _WithExtraState, 7)
    for label, call in (("full_state_dict", lambda: model.full_state_dict()),
                        ("save_dcp", lambda: save_dcp(directory + "_x", model)),
                        ("save_consolidated", lambda: save_consolidated(directory + "_x.pth",
                                                                        model)),
                        ("load_dcp", lambda: load_dcp(good, model))):
        try:
            call()
            out[f"extra_state_{label}"] = "no error"
        except CheckpointError as exc:
            out[f"extra_state_{label}"] = str(exc)
    save_sharded(directory + "_extra", model)
    stateful.calls = 0
    load_sharded(directory + "_extra", model)
    out["extra_state_per_rank"] = stateful.calls


class _Opens:
    """Unpickling this creates ``path``: a hostile ``.metadata``, observably."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _refusals(rank, good, bad):
    """Each bad checkpoint raises CheckpointError (its message returned) and leaves the
    model and optimizer as they were; a hostile ``.metadata`` runs nothing, through
    ``load_dcp`` or ``load_consolidated``."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    from xla_fsdp.checkpoint import CheckpointError, load_consolidated, load_dcp
    model = wrap(build("net", 1), "nested", rank)
    opt = optimizer("adamw", model)
    load_dcp(good, model, opt)
    before = snapshot(model, opt)
    if rank == 0:
        shutil.rmtree(bad, ignore_errors=True)
        os.makedirs(bad + "_empty", exist_ok=True)
        shutil.copytree(good, bad + "_truncated")
        shutil.copytree(good, bad + "_missing")
        data = sorted(f for f in os.listdir(good) if f.endswith(".distcp"))
        with open(os.path.join(bad + "_truncated", data[1]), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(good, data[1])) // 2)
        os.remove(os.path.join(bad + "_missing", data[2]))
        shutil.copytree(good, bad + "_hostile")
        with open(os.path.join(bad + "_hostile", ".metadata"), "wb") as f:
            f.write(pickle.dumps(_Opens(bad + "_code_ran")))
    xm.rendezvous("damaged")  # every rank sees the damaged copies
    wider = Net()
    wider.added = torch.nn.Linear(2, 2)
    other_head = Net()
    other_head.head = torch.nn.Linear(32, 7)
    cases = {"no_directory": (good + "_nope", model, opt),
             "no_metadata": (bad + "_empty", model, opt),
             "truncated": (bad + "_truncated", model, opt),
             "missing_file": (bad + "_missing", model, opt),
             "hostile_metadata": (bad + "_hostile", model, opt),
             "other_class": (good, model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                          momentum=0.9))}
    out = {}
    for label, (path, target, target_opt) in cases.items():
        try:
            load_dcp(path, target, target_opt)
            out[label] = "no error"
        except CheckpointError as exc:
            out[label] = str(exc)
    for label, other in (("missing_keys", wider), ("shape", other_head)):
        target = wrap(other, "nested", rank)
        try:
            load_dcp(good, target)
            out[label] = "no error"
        except CheckpointError as exc:
            out[label] = str(exc)
    try:  # the same directory through the other public reader
        load_consolidated(bad + "_hostile", model, opt)
        out["hostile_consolidated"] = "no error"
    except CheckpointError as exc:
        out["hostile_consolidated"] = str(exc)
    # param groups: one of the optimizer's held parameters saved with other settings; a
    # group of no parameters keeps its own settings (none were saved under a name)
    from xla_fsdp.checkpoint import save_dcp
    params = list(model.named_parameters())
    split = torch.optim.AdamW([
        {"params": [p for n, p in params if "bias" in n], "lr": 1e-3, "weight_decay": 0.0},
        {"params": [p for n, p in params if "bias" not in n], "lr": 1e-2}])
    save_dcp(bad + "_groups", model, split)
    try:
        load_dcp(bad + "_groups", model, opt)
        out["group_layout"] = "no error"
    except CheckpointError as exc:
        out["group_layout"] = str(exc)
    emptied = torch.optim.AdamW([{"params": [p for _, p in params]}, {"params": [], "lr": 0.5}])
    save_dcp(bad + "_empty_group", model, emptied)
    again = torch.optim.AdamW([{"params": [p for _, p in params]}, {"params": [], "lr": 0.25}])
    load_dcp(bad + "_empty_group", model, again)
    out["empty_group"] = {k: v for k, v in again.param_groups[1].items() if k != "params"}
    # a state dict hook's change to a group is saved, as by the other formats
    hooked = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hooked.register_state_dict_post_hook(lambda _, saved: saved["param_groups"][0].update(lr=0.5))
    save_dcp(bad + "_hooked_group", model, hooked)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_dcp(bad + "_hooked_group", model, fresh)
    out["hooked_group"] = (fresh.param_groups[0]["lr"], hooked.param_groups[0]["lr"])
    _extra_state_refusals(rank, bad, good, out)
    out["code_ran"] = os.path.exists(bad + "_code_ran")
    out["unchanged"] = [same_state(a, b) for a, b in zip(before, snapshot(model, opt), strict=True)]
    torch_xla.sync()
    return out
