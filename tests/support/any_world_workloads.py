"""Checkpoints of every layout saved at N = 4 after a few AdamW steps, per-rank
(``save_sharded``) and DCP (``save_dcp``), loaded at N = 2 and 8 straight from those files
(``load_sharded``, ``load_dcp``) and trained on; the same models trained unsharded on one
device; bad per-rank checkpoints refused. Flat shards (torch_xla's, the default off a TPU)
and row blocks (a TPU's default) are each loaded into the other, at N = 2, 4 and 8. Run inside ``tests/checkpoint/test_roundtrip.py``'s
launches (``save_layouts`` at N = 4, ``unsharded_layouts`` at N = 1, ``resume_layouts`` at
N = 2 and 8), so that they add no launch of their own.

Bounds (AdamW in fp32, as the parity suite holds it): every loss after the load within 1e-5
relative of unsharded training's; every parameter within 2 * lr * steps, and at most 1% of
a parameter's elements beyond 1e-5. The state loaded equals the state saved exactly, and a
per-rank load and a DCP load train on identically.
"""
import os
import shutil
import threading

import torch

from .checkpoint_workloads import same_state, snapshot, train as train_steps
from .models import Net, Stack, TiedLM
from .parity import paired
from .synthetic_checkpoints import flip_a_tensor_byte

LR = 1e-3
BEFORE, AFTER = range(0, 2), range(2, 4)
SAVE_WORLD = 4
# name: (model kind, wrapping saved, wrapping loaded into at N = 2 and 8)
LAYOUTS = {
    "nested_tied": ("tied", "nested", "nested"),
    "flattened": ("net", "flattened", "flattened"),
    # flat shards (torch_xla's, the default off a TPU) and row blocks (a TPU's default), each
    # loaded into the other; with a persistent buffer placed in bf16
    "flat": ("net", "flat", "dim0"),
    "dim0_buffer": ("net", "dim0", "flat"),
    "scanned": ("stack", "scanned", "scanned"),   # ScannedLayers, flattened: interleaved rows
    "groups": ("net", "groups", "groups"),        # independent sharding groups, files per group
    "hybrid": ("net", "hybrid", "hybrid"),        # replicate_across_groups: the first group writes
    # vocab_parallel's row-block table in a flattened root, into flat shards, and back
    "vocab_into_flat": ("tied", "vocab", "nested"),
    "flat_into_vocab": ("tied", "nested", "vocab"),
}
ACROSS = ("flat", "dim0_buffer")   # also loaded into the other layout at N = 4, and trained on
BUFFER = "b2.seen"   # the flat and dim-0 layouts' buffer, set before the save to values bf16 holds


def build(kind, seed):
    torch.manual_seed(seed)
    if kind == "tied":
        return TiedLM()
    if kind == "stack":
        return Stack()
    model = Net()
    model.b2.register_buffer("seen", torch.zeros(6))
    return model


def _sharding_group_size(how, world):
    return world // 2 if how in ("groups", "hybrid") else world


def wrap(model, how, world, rank):
    from xla_fsdp import FSDP, ScannedLayers
    kw = {"flatten_parameters": how in ("flattened", "vocab"),
          "shard_param_on_dim_0": how == "dim0", "vocab_parallel": how == "vocab"}
    if how in ("flat", "dim0"):
        kw["buffer_dtype"] = torch.bfloat16
    if how in ("groups", "hybrid"):
        size = _sharding_group_size(how, world)
        kw.update(sharding_groups=[list(range(i, i + size)) for i in range(0, world, size)],
                  sharding_rank=rank % size, sharding_world_size=size,
                  replicate_across_groups=how == "hybrid")
    if how == "scanned":
        model.layers = ScannedLayers(model.layers, flatten_parameters=True)
        return FSDP(model)
    model.b1, model.b2 = FSDP(model.b1, **kw), FSDP(model.b2, **kw)
    return FSDP(model, **kw)


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def train(model, opt, kind, steps, rank, world, split):
    """AdamW steps, each rank on its part of the batch (``split`` parts); returns the
    losses averaged over every rank (the global batch's: every group sees all of it)."""
    return train_steps(model, opt, steps, rank, world, "tied" if kind == "tied" else "net",
                       split)


def _split(how, world):
    return _sharding_group_size(how, world) if how == "groups" else world


def save_layouts(rank, root):
    """At N = 4: every layout trained ``BEFORE`` and saved both ways; its full state dict
    (group 0's for independent groups). Also a per-rank checkpoint loaded at N = 4 into
    another wrapping (flattened into dim-0), whose state must be the one saved."""
    import torch_xla
    import torch_xla.runtime as xr
    from xla_fsdp.checkpoint import load_sharded, save_dcp, save_sharded
    world = xr.world_size()
    out = {}
    for name, (kind, how, _) in LAYOUTS.items():
        model = wrap(build(kind, 0), how, world, rank)
        opt = optimizer(model)
        train(model, opt, kind, BEFORE, rank, world, _split(how, world))
        if kind == "net":
            with torch.no_grad():
                dict(model.named_buffers())[_wrapped_name(model, BUFFER)].copy_(
                    torch.arange(6.0) * 1.5)
        save_sharded(os.path.join(root, name), model, opt, extra={"layout": name})
        save_dcp(os.path.join(root, name + "_dcp"), model, opt, extra={"layout": name})
        out[name] = model.full_state_dict(rank0_only=False)
        torch_xla.sync()
    other = wrap(build("net", 1), "dim0", world, rank)
    extra = load_sharded(os.path.join(root, "flattened"), other, optimizer(other))
    out["flattened_into_dim0"] = {"extra": extra,
                                  "state": other.full_state_dict(rank0_only=False)}
    torch_xla.sync()
    # saved again right after the load, so that its outputs can be held to the source's
    out["across"] = {name: {"per_rank": _resume(name, root, "per_rank", rank, world,
                                                resave=os.path.join(root, name + "_across"))}
                     for name in ACROSS}
    return out


def _wrapped_name(model, name):
    from xla_fsdp._sharding.names import clean_name
    return next(k for k, _ in model.named_buffers() if clean_name(k) == name)


def unsharded_layouts():
    """At N = 1: each model kind trained ``BEFORE`` and ``AFTER`` unsharded; the losses of
    ``AFTER`` and the parameters at the end."""
    import torch_xla
    device = torch_xla.device()
    out = {}
    for kind in sorted({kind for kind, _, _ in LAYOUTS.values()}):
        model = build(kind, 0).to(device)
        if kind == "tied":
            model.head.weight = model.emb.weight  # moving to XLA unties
        opt = optimizer(model)
        train(model, opt, kind, BEFORE, 0, 1, 1)
        losses = train(model, opt, kind, AFTER, 0, 1, 1)
        params = {k: v.detach().cpu() for k, v in model.named_parameters()}
        if kind == "tied":
            params["head.weight"] = params["emb.weight"]
        out[kind] = {"losses": losses, "params": params}
    return out


class ReadCounter:
    """Bytes each rank (device thread) reads through ``CheckpointFile.pread_into``: the
    tensor reads of a load through the source (CRC checks read otherwise)."""

    def __init__(self):
        self.by_rank = {}
        self._lock = threading.Lock()
        self._installed = False

    def install(self):
        from xla_fsdp.checkpoint.files import CheckpointFile
        with self._lock:
            if self._installed:
                return
            self._installed = True
        original = CheckpointFile.pread_into

        def counted(file, key, offset, out):
            import torch_xla.runtime as xr
            original(file, key, offset, out)
            with self._lock:
                rank = xr.global_ordinal()
                self.by_rank[rank] = self.by_rank.get(rank, 0) + memoryview(out).nbytes
        CheckpointFile.pread_into = counted

    def of_this_rank(self):
        import torch_xla.runtime as xr
        return self.by_rank.get(xr.global_ordinal(), 0)


COUNTER = ReadCounter()


def resume_layouts(rank, root):
    """At N = 2 or 8: every layout loaded both ways into a model initialised otherwise, its
    state right after a per-rank load, the bytes that load read here, and the losses and
    parameters of training ``AFTER``; at N = 2 also the refusals."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    world = xr.world_size()
    COUNTER.install()
    xm.rendezvous("xla_fsdp.test.any_world.counter")  # installed before any rank reads
    out = {name: {fmt: _resume(name, root, fmt, rank, world) for fmt in ("per_rank", "dcp")}
           for name in LAYOUTS}
    if world == 2:
        out["refusals"] = _refusals(rank, root)
        out["own_extras"] = _own_extras(rank, root)
    return out


def _own_extras(rank, root):
    """Each rank's own ``extra`` back at the world size that saved it, from per-rank files
    read into another wrapping (the source, not the own file) and from DCP; a common one
    saved once (see [Note: each rank's extra])."""
    import torch_xla.runtime as xr
    from xla_fsdp.checkpoint import load_dcp, load_sharded, save_dcp, save_sharded
    world = xr.world_size()
    model = wrap(build("net", 1), "nested", world, rank)
    out = {}
    for label, extra in (("own", {"rank": rank}), ("common", {"step": 3})):
        save_sharded(os.path.join(root, f"extras_{label}"), model, None, extra=extra)
        save_dcp(os.path.join(root, f"extras_{label}_dcp"), model, None, extra=extra)
        other = wrap(build("net", 2), "flattened", world, rank)
        out[label] = (load_sharded(os.path.join(root, f"extras_{label}"), other, None),
                      load_dcp(os.path.join(root, f"extras_{label}_dcp"), model, None))
    out["common_dcp_keys"] = sorted(
        k for k in _dcp_keys(os.path.join(root, "extras_common_dcp")) if "extra" in k)
    # replicas (two groups of one rank here): only the first group writes, and each
    # replica's rank gets its own back ([Note: each replica's extra])
    hybrid = wrap(build("net", 1), "hybrid", world, rank)
    save_sharded(os.path.join(root, "extras_replicas"), hybrid, None, extra={"rank": rank})
    save_dcp(os.path.join(root, "extras_replicas_dcp"), hybrid, None, extra={"rank": rank})
    out["replicas"] = (load_sharded(os.path.join(root, "extras_replicas"), hybrid, None),
                       load_dcp(os.path.join(root, "extras_replicas_dcp"), hybrid, None))
    # a checkpoint of the whole model, loaded into independent groups: refused, naming it
    groups = wrap(build("net", 1), "groups", world, rank)
    out["into_groups"] = [_refusal(lambda: load(os.path.join(root, name), groups, None))
                          for load, name in ((load_sharded, "extras_own"),
                                             (load_dcp, "extras_own_dcp"))]
    return out


def _refusal(load):
    from xla_fsdp.checkpoint import CheckpointError
    try:
        load()
        return "no error"
    except CheckpointError as exc:
        return str(exc)


def _dcp_keys(directory):
    from torch.distributed.checkpoint import FileSystemReader
    return FileSystemReader(directory).read_metadata().state_dict_metadata


def _resume(name, root, fmt, rank, world, resave=None):
    """Layout ``name``'s checkpoint loaded one way (``fmt``) into the wrapping it is loaded
    into, from a model initialised otherwise (and saved again to ``resave``), then trained
    ``AFTER``."""
    import torch_xla
    from xla_fsdp.checkpoint import load_dcp, load_sharded, save_sharded
    from xla_fsdp._sharding.names import clean_name
    kind, _, how = LAYOUTS[name]
    model = wrap(build(kind, 1), how, world, rank)
    opt = optimizer(model)
    path = os.path.join(root, name)
    before = COUNTER.of_this_rank()
    if fmt == "per_rank":
        extra = load_sharded(path, model, opt)
        loaded = model.full_state_dict(rank0_only=False)
    else:
        extra = load_dcp(path + "_dcp", model, opt)
        loaded = None
    read = COUNTER.of_this_rank() - before
    if resave is not None:
        save_sharded(resave, model, opt, extra=extra)
    losses = train(model, opt, kind, AFTER, rank, world, _split(how, world))
    buffers = {clean_name(k) for k, _ in model.named_buffers()}
    params = {k: v for k, v in model.full_state_dict(rank0_only=False).items()
              if k not in buffers}
    torch_xla.sync()
    return {"extra": extra, "loaded": loaded, "bytes": read, "losses": losses,
            "params": params}


def _refusals(rank, root):
    """Each bad per-rank checkpoint raises CheckpointError on every rank (its message
    returned) and leaves the model and optimizer as they were."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from xla_fsdp.checkpoint import (CheckpointError, load_sharded, save_sharded,
                                     sharded_checkpoint_path)
    world = xr.world_size()
    source = os.path.join(root, "nested_tied")
    bad = os.path.join(root, "bad")
    if rank == 0:
        os.makedirs(bad, exist_ok=True)
        for r in range(SAVE_WORLD):
            for label in ("missing", "corrupt"):
                if label == "missing" and r == 3:
                    continue
                shutil.copy(sharded_checkpoint_path(source, r, SAVE_WORLD),
                            sharded_checkpoint_path(os.path.join(bad, label), r, SAVE_WORLD))
        flip_a_tensor_byte(sharded_checkpoint_path(os.path.join(bad, "corrupt"), 1,
                                                    SAVE_WORLD))
    xm.rendezvous("xla_fsdp.test.any_world.damaged")  # every rank sees the damaged copies
    model = wrap(build("tied", 1), "nested", world, rank)
    opt = optimizer(model)
    load_sharded(source, model, opt)
    before = snapshot(model, opt)
    cases = {"other_model": os.path.join(root, "flattened"),
             "missing_rank": os.path.join(bad, "missing"),
             "corrupt": os.path.join(bad, "corrupt"),
             "no_checkpoint": os.path.join(root, "nope")}
    out = {}
    for label, path in cases.items():
        try:
            load_sharded(path, model, opt)
            out[label] = "no error"
        except CheckpointError as exc:
            out[label] = str(exc)
    # this world size's own files (each rank reads its own) into another optimizer class
    own = os.path.join(root, f"own_at_{world}")
    save_sharded(own, model, opt)
    for label, other in (("other_class", torch.optim.SGD(model.parameters(), lr=0.1,
                                                          momentum=0.9)),
                         # every setting of Adamax is AdamW's: AdamW's own are told apart
                         ("other_class_subset", torch.optim.Adamax(model.parameters()))):
        try:
            load_sharded(own, model, other)
            out[label] = "no error"
        except CheckpointError as exc:
            out[label] = str(exc)
    out["unchanged"] = [same_state(a, b) for a, b in zip(before, snapshot(model, opt), strict=True)]
    torch_xla.sync()
    return out


def check_resumed(saved, reference, resumed, world):
    """Problems of ``resume_layouts``' results at ``world`` against the state saved at
    N = 4 (``save_layouts``, rank 0's) and unsharded training (``unsharded_layouts``)."""
    problems = []
    for name, (kind, _, how) in LAYOUTS.items():
        ref = reference[kind]
        size = _sharding_group_size(how, world)
        # what a rank may read: its share of every parameter and both AdamW moments (up to
        # a row more: a dim-0 shard holds whole rows), a step count per parameter, and the
        # buffers whole
        held = {k: v for k, v in ref["params"].items() if not _alias(kind, k)}
        numels = [v.numel() for v in held.values()]
        rows = sum(v.numel() // v.shape[0] if v.dim() else 1 for v in held.values())
        buffers = sum(v.numel() * 2 for k, v in saved[name].items() if k == BUFFER)
        most = 3 * 4 * (sum(numels) / size + rows) + 4 * len(numels) + buffers
        for rank, result in resumed.items():
            runs = result["layouts"][name]
            for fmt, run in runs.items():
                problems += _check_run(run, name, saved[name], ref,
                                       f"{name} ({fmt}) at N={world}, rank {rank}")
            if runs["per_rank"]["losses"] != runs["dcp"]["losses"]:
                problems.append(f"{name} at N={world}, rank {rank}: per-rank "
                                f"{runs['per_rank']['losses']}, DCP {runs['dcp']['losses']}")
            if runs["per_rank"]["bytes"] > most:
                problems.append(f"{name} at N={world}, rank {rank}: read "
                                f"{runs['per_rank']['bytes']} bytes, more than its {most:.0f}")
        read = sum(r["layouts"][name]["per_rank"]["bytes"] for r in resumed.values())
        if read < 3 * 4 * sum(numels):
            problems.append(f"{name} at N={world}: the ranks read {read} bytes together, "
                            f"less than the {3 * 4 * sum(numels)} of the state")
    return problems


def check_across(saved, reference):
    """Problems of ``save_layouts``' loads into the other layout at N = 4 (``ACROSS``),
    against the state saved and unsharded training (``unsharded_layouts``)."""
    problems = []
    for rank, result in saved.items():
        for name in ACROSS:
            kind = LAYOUTS[name][0]
            problems += _check_run(result["layouts"]["across"][name]["per_rank"], name,
                                   saved[0]["layouts"][name], reference[kind],
                                   f"{name} into {LAYOUTS[name][2]} at N=4, rank {rank}")
    return problems


def _check_run(run, name, saved, ref, where):
    """A load's problems: the extra and the state saved come back exactly, and training on
    from it follows unsharded training within the parity suite's AdamW bounds."""
    problems = []
    if run["extra"] != {"layout": name}:
        problems.append(f"{where}: extra {run['extra']}")
    if run["loaded"] is not None:
        problems += _differences(run["loaded"], saved, where)
    for step, (a, b) in paired(run["losses"], ref["losses"]):
        if abs(a - b) > 1e-5 * abs(b):
            problems.append(f"{where}: step {step} loss {a:.7g}, unsharded {b:.7g}")
    if run["params"].keys() != ref["params"].keys():
        return problems + [f"{where}: parameters "
                           f"{sorted(set(run['params']) ^ set(ref['params']))}"]
    for key, want in ref["params"].items():
        diff = (run["params"][key] - want).abs()
        if diff.max() > 2 * LR * (len(BEFORE) + len(AFTER)) \
                or (diff > 1e-5).float().mean() > 0.01:
            problems.append(f"{where}: {key} max diff {diff.max():.3g}, "
                            f"{(diff > 1e-5).float().mean():.2%} beyond 1e-5")
    return problems


def _alias(kind, name):
    return kind == "tied" and name == "head.weight"


def _differences(got, want, where):
    if got.keys() != want.keys():
        return [f"{where}: loaded {sorted(set(got) ^ set(want))}"]
    return [f"{where}: {key} loaded is not the {key} saved" for key, value in want.items()
            if got[key].dtype != value.dtype or not torch.equal(got[key], value)]
