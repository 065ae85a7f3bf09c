"""The model and training loop the checkpoint tests save, consolidate, reshard and resume."""
import torch

from .models import GLOBAL_BATCH, Net, batch, loss_fn
from .checks import every

LR, MOMENTUM = 0.1, 0.9


def wrapped_net(**kwargs):
    """Net with three sharding modes at once: a flattened unit, a dim-0 unit, a plain root."""
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    model = Net()
    model.b1 = FSDP(model.b1, flatten_parameters=True, **kwargs)
    model.b2 = FSDP(model.b2, shard_param_on_dim_0=True, **kwargs)
    return FSDP(model, **kwargs)


def optimizer_for(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def train(model, opt, steps, rank, world, data="net", split=None):
    """Optimizer steps, each rank on its part of each global batch of ``data`` (``split``
    parts, ``world`` unless given); returns the losses averaged over every rank."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    device = torch_xla.device()
    losses = []
    split = split or world
    local, part = GLOBAL_BATCH // split, rank % split
    for step in steps:
        x, y = batch(data, step)
        x, y = x[part * local:(part + 1) * local], y[part * local:(part + 1) * local]
        opt.zero_grad()
        loss = loss_fn(data, model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        if world > 1:
            loss = xm.all_reduce(xm.REDUCE_SUM, loss.detach(), scale=1.0 / world)
        torch_xla.sync()
        losses.append(loss.item())
    return losses


def snapshot(model, opt):
    """Copies of the full state dict (every rank) and of the optimizer's tensors."""
    state = {k: v.clone() for k, v in model.full_state_dict(rank0_only=False).items()}
    opt_state = {(i, k): v.cpu().clone() for i, s in enumerate(opt.state.values())
                 for k, v in s.items() if torch.is_tensor(v)}
    return state, opt_state


def same_state(a, b):
    """Whether two state dicts hold equal tensors under the same keys (and hold some)."""
    return a.keys() == b.keys() and every((torch.equal(a[k], b[k]) for k in a), "state entries")


def same_snapshot(a, b):
    """Whether two ``snapshot``s (model and optimizer) are equal."""
    return len(a) == len(b) and every(same_state(x, y) for x, y in zip(a, b, strict=True))


def tree_differences(a, b, where=""):
    """Where two loaded checkpoints' trees differ: keys, lengths, tensors' dtypes, shapes,
    devices or values, other values; empty when they are the same."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and \
            a.shape == b.shape and a.device == b.device and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [p for k in a for p in tree_differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} and {len(b)}"]
        return [p for i, (x, y) in enumerate(zip(a, b, strict=True))
                for p in tree_differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def assert_same_tree(a, b, where=""):
    problems = tree_differences(a, b, where)
    assert not problems, "\n".join(problems)


def frames_keeping(exc):
    """The functions ``exc`` passed through, below the one handling it, whose frames still
    name it in a local: each closes a reference cycle that keeps everything the frame held
    alive until the garbage collector runs (see [Note: no frame keeps the exception it
    raises])."""
    kept, tb = [], exc.__traceback__.tb_next   # the handler names it while it handles it
    while tb is not None:
        if any(value is exc for value in tb.tb_frame.f_locals.values()):
            kept.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return kept


def commit_fails_on_one_rank(rank, world, directory):
    """A checkpoint every rank reads, whose optimizer state torch refuses on the last rank
    only, after the shards would have been replaced: every rank raises and every rank keeps
    its model and optimizer as they were, for each loader."""
    import os
    from xla_fsdp.checkpoint import load_consolidated, load_dcp, load_sharded, \
        save_consolidated, save_dcp, save_sharded
    model = wrapped_net()
    opt = optimizer_for(model)
    train(model, opt, range(2), rank, world)
    paths = {"dcp": os.path.join(directory, "dcp"), "sharded": os.path.join(directory, "ck"),
             "consolidated": os.path.join(directory, "full.pth")}
    save_dcp(paths["dcp"], model, opt)
    save_sharded(paths["sharded"], model, opt)
    save_consolidated(paths["consolidated"], model, opt)
    train(model, opt, range(2, 4), rank, world)   # what the loads would replace
    before = snapshot(model, opt)
    refuse = opt.load_state_dict
    if rank == world - 1:
        def refusing(state_dict):
            raise ValueError("refused by this rank's optimizer")
        opt.load_state_dict = refusing
    out = {}
    for kind, load in (("dcp", load_dcp), ("sharded", load_sharded),
                       ("consolidated", load_consolidated)):
        try:
            load(paths[kind], model, opt)
            out[kind] = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is what is tested
            out[kind] = f"{type(exc).__name__}: {exc}"
            out[f"{kind}_kept_by"] = frames_keeping(exc)
        out[f"{kind}_unchanged"] = same_snapshot(snapshot(model, opt), before)
    opt.load_state_dict = refuse
    # an extra the last rank cannot pickle: every rank's save raises, none is left waiting
    extra = (lambda: None) if rank == world - 1 else {"step": 4}
    for kind, save in (("dcp", save_dcp), ("sharded", save_sharded),
                       ("consolidated", save_consolidated)):
        try:
            save(paths[kind] + "_unpicklable", model, opt, extra=extra)
            out[f"{kind}_unpicklable"] = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is what is tested
            out[f"{kind}_unpicklable"] = f"{type(exc).__name__}: {exc}"
    out["mixed"], out["mixed_kept_by"] = _files_of_two_runs(rank, world, directory,
                                                            paths["sharded"], model, opt)
    out["mixed_unchanged"] = same_snapshot(snapshot(model, opt), before)
    out["bare_state_dicts"] = _bare_state_dicts(rank, world, directory, model, opt)
    # the saved optimizer's one param group, loaded into two: at the saving world size as
    # at any other (the own file is read as the source reads it), each group taking the
    # saved settings, as torch's load_state_dict gives them
    params = list(model.parameters())
    regrouped = torch.optim.SGD([{"params": params[:1], "lr": 0.5},
                                 {"params": params[1:], "lr": 0.7}], momentum=MOMENTUM)
    load_sharded(paths["sharded"], model, regrouped)
    out["regrouped"] = ([g["lr"] for g in regrouped.param_groups], len(regrouped.state),
                        len(opt.state), opt.param_groups[0]["lr"])
    return out


def _files_of_two_runs(rank, world, directory, prefix, model, opt):
    """Rank 1's file taken from another run's first save (a model of the same wrapping
    trained as many steps on other data), beside the others of this run's first save: both
    are save 1 of their model after the same steps, so only the id each save drew tells
    them apart. ``load_sharded`` at the saving world size must refuse the mix, as it does at
    any other."""
    import os
    import shutil
    import torch_xla.core.xla_model as xm
    from xla_fsdp.checkpoint import load_sharded, save_sharded
    from xla_fsdp.checkpoint.formats.per_rank import sharded_checkpoint_path
    other = wrapped_net()
    other_opt = optimizer_for(other)
    train(other, other_opt, range(10, 12), rank, world)
    save_sharded(os.path.join(directory, "other"), other, other_opt)
    mixed = os.path.join(directory, "mixed")
    for r in range(world):
        source = os.path.join(directory, "other") if r == 1 else prefix
        if r == rank:
            shutil.copy(sharded_checkpoint_path(source, r, world),
                        sharded_checkpoint_path(mixed, r, world))
    xm.rendezvous("copied")
    try:
        load_sharded(mixed, model, opt)
        return "no error", None
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__}: {exc}", frames_keeping(exc)


def _bare_state_dicts(rank, world, directory, model, opt):
    """Each rank's ``model.state_dict()`` saved with ``torch.save`` under the per-rank names
    (its shards without the shard metadata): ``load_sharded`` names the file and says how
    to save, as the consolidation tool does."""
    import os
    import torch_xla.core.xla_model as xm
    from xla_fsdp.checkpoint import load_sharded
    from xla_fsdp.checkpoint.formats.per_rank import sharded_checkpoint_path
    bare = os.path.join(directory, "bare")
    torch.save({k: v.cpu() for k, v in model.state_dict().items()},
               sharded_checkpoint_path(bare, rank, world))
    xm.rendezvous("bare saved")
    try:
        load_sharded(bare, model, opt)
        return "no error"
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__}: {exc}"
