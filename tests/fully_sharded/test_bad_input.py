"""Each misuse of the wrapper gets an error that names what is at fault (one launch)."""
import torch
import torch.nn as nn

from xla_fsdp import launch
from ..support.checks import every, nonempty, pairs
from ..support.optimizer_misuses import Tiny, error_of, full_optimizer_state


class ReadsInnerGain(nn.Module):
    """The outer forward adds a penalty over an inner unit's parameter (freed: its sum was 0)."""

    def __init__(self):
        super().__init__()
        self.inner = Tiny()
        self.inner.gain = nn.Parameter(torch.tensor(0.7))
        self.out = Tiny()

    def forward(self, x):
        h = self.inner(x)
        return self.out(h) + 1e-2 * self.inner.lin.weight.pow(2).sum() + self.inner.gain


class Stack(nn.Module):
    """A layer, then two scanned ones."""

    def __init__(self):
        super().__init__()
        from xla_fsdp import ScannedLayers
        self.first = Tiny()
        self.layers = ScannedLayers(nn.ModuleList([Tiny(), Tiny()]))

    def forward(self, x):
        x = self.first(x)
        for layer in self.layers:
            x = layer(x)
        return x


class Attends(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2)

    def forward(self, x):
        return self.attn(x, x, x)[0]


class ClampsItsWeight(Tiny):
    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-0.1, 0.1)
        return super().forward(x)


def misuses(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm
    from xla_fsdp import FSDP
    out = {}
    out["double_wrap"] = error_of(lambda: FSDP(FSDP(Tiny())))
    out["module_list"] = error_of(lambda: FSDP(nn.ModuleList([Tiny()])))
    from xla_fsdp import ScannedLayers
    out["scan_unknown_option"] = error_of(
        lambda: ScannedLayers(nn.ModuleList([Tiny(), Tiny()]), reshard_after_fwd=False))
    out["scan_twice"] = error_of(lambda: ScannedLayers(ScannedLayers([Tiny(), Tiny()])))
    import warnings
    with warnings.catch_warnings(record=True) as seen:   # a whole unit's schedule: ignored
        warnings.simplefilter("always")
        ScannedLayers([Tiny(), Tiny()], reshard_after_forward=False, zero_missing_gradients=True,
                      compute_dtype=torch.float32, reduce_scatter_bucket_size_mb=0)
    out["scan_unit_options"] = [str(w.message) for w in seen if "ignores" in str(w.message)]
    int_param = Tiny()
    int_param.lin.steps = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    out["int_param"] = error_of(lambda: FSDP(int_param))
    out["dtype"] = error_of(lambda: FSDP(Tiny(), compute_dtype=torch.int8))
    retried = Tiny().to(torch.bfloat16)   # refused, then wrapped once fixed
    out["retried"] = [error_of(lambda: FSDP(retried)), error_of(lambda: FSDP(retried.float()))]
    # a parameter assigned to a wrapped module after the first forward: never sharded
    grown = FSDP(nn.Sequential(FSDP(Tiny()), Tiny()))
    grown(torch.ones(2, 4).to(torch_xla.device())).sum().backward()
    grown.module[1].lin.bias = nn.Parameter(torch.zeros(4, device=torch_xla.device()))
    out["added_after_first_forward"] = error_of(
        lambda: grown(torch.ones(2, 4).to(torch_xla.device())))
    torch_xla.sync()
    # unwrapped weights loaded below the root: torch's loader would skip the placeholders
    nested = FSDP(nn.Sequential(FSDP(Tiny()), Tiny()))
    weights = Tiny().state_dict()
    before = [t.clone() for t in nested.parameters()]
    out["load_below_root"] = [
        error_of(lambda: nested.module[0].load_state_dict(weights, strict=False)),
        error_of(lambda: nested.module[1].load_state_dict(weights, strict=False)),
        error_of(lambda: nested.module[1].lin.load_state_dict(Tiny().lin.state_dict())),
        every(torch.equal(a, b) for a, b in zip(before, nested.parameters(), strict=True))]
    # left out, the rank's place and the group size follow from the groups
    derived = FSDP(Tiny(), sharding_groups=[[1, 0]])
    out["groups_no_rank"] = [derived.rank, derived.world_size]
    out["groups_cover"] = error_of(lambda: FSDP(Tiny(), sharding_groups=[[0]], sharding_rank=0,
                                              sharding_world_size=1))
    # a unit sharded over other ranks than its root: the norm, loss scaling and checkpoints
    # reduce over the root's ranks
    hybrid = dict(sharding_groups=[[0], [1]], sharding_rank=0, sharding_world_size=1,
                  replicate_across_groups=True)
    # the same sharding written two ways (the default, and every rank named) is no mix
    out["groups_same"] = error_of(lambda: FSDP(nn.Sequential(
        FSDP(Tiny(), sharding_groups=[[0, 1]], sharding_rank=rank, sharding_world_size=2),
        Tiny())))
    out["groups_mixed"] = [error_of(lambda: FSDP(nn.Sequential(FSDP(Tiny(), **hybrid), Tiny()))),
                           error_of(lambda: FSDP(nn.Sequential(FSDP(Tiny()), Tiny()), **hybrid))]
    shared = nn.Sequential(Tiny(), Tiny())
    shared[1].lin.weight = shared[0].lin.weight
    shared[0] = FSDP(shared[0])
    out["tied_across_units"] = error_of(lambda: FSDP(shared))
    with torch.device("meta"):
        on_meta = Tiny()
    out["init_fn_leaves_meta"] = error_of(lambda: FSDP(on_meta, param_init_fn=lambda m: None))
    # optimizer created before wrapping
    early = Tiny()
    stale_opt = torch.optim.SGD(early.parameters(), lr=0.1)
    FSDP(early)
    out["optimizer_before_wrap"] = error_of(stale_opt.step)
    group = FSDP(Tiny()).module.lin.parameters()   # a group of an inner module's: placeholders
    out["inner_module_group"] = error_of(torch.optim.SGD([{"params": group}], lr=0.1).step)
    # xm.optimizer_step on sharded gradients, and clip_grad_norm_ on a nested unit
    inner = FSDP(Tiny())
    model = FSDP(nn.Sequential(inner, Tiny()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4).to(torch_xla.device())).sum().backward()
    out["xm_optimizer_step"] = error_of(lambda: xm.optimizer_step(opt))
    out["clip_nested"] = error_of(lambda: inner.clip_grad_norm_(1.0))
    torch_xla.sync()
    # after a sync the step's audit sees nothing pending: refused where they are called
    # ([Note: clipping and averaging refused where they are called]); other tensors pass
    out["torch_clip_after_sync"] = error_of(
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    out["reduce_gradients"] = error_of(lambda: xm.reduce_gradients(opt))
    # torch's two-call clipping: the norm of this rank's slices, then the clip
    local_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    out["torch_clip_two_calls"] = error_of(
        lambda: torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, local_norm))
    plain = torch.ones(3, requires_grad=True)
    plain.grad = torch.full((3,), 4.0)
    out["torch_clip_plain"] = float(torch.nn.utils.clip_grad_norm_([plain], 1.0))
    # a weight clamped through its module's attribute between steps: a placeholder there,
    # which refuses it; a write no check saw (here, with the check off) is refused later
    with torch.no_grad():
        out["placeholder_clamp"] = error_of(lambda: inner.module.lin.weight.clamp_(-0.1, 0.1))
        with torch._C.DisableTorchFunctionSubclass():
            inner.module.lin.weight.clamp_(-0.1, 0.1)
    # nor saved without it, before that forward
    out["placeholder_write_saved"] = [error_of(model.state_dict), error_of(model.full_state_dict)]
    out["placeholder_write"] = error_of(lambda: model(torch.ones(2, 4).to(torch_xla.device())))
    torch_xla.sync()
    # a parameter read outside its unit's forward: fails there, even where no gradient
    # would reach it (see [Note: a freed placeholder is empty])
    reads = ReadsInnerGain()
    reads.inner = FSDP(reads.inner)
    reads = FSDP(reads)
    with torch.no_grad():
        out["read_outside_unit"] = error_of(lambda: reads(torch.ones(2, 4).to(torch_xla.device())))
    torch_xla.sync()
    # a unit inside nn.MultiheadAttention, which reads out_proj's weight without calling it
    attention = Attends()
    attention.attn.out_proj = FSDP(attention.attn.out_proj)
    attention = FSDP(attention)
    out["attention_out_proj"] = error_of(lambda: attention(torch.ones(3, 1, 4).to(
        torch_xla.device())))
    # a forward writing its own weight, twice (see [Note: writes to a held full value])
    clamps = FSDP(ClampsItsWeight())
    out["written_while_held"] = [error_of(lambda: clamps(torch.ones(2, 4).to(
        torch_xla.device())).sum().backward()) for _ in range(2)]
    torch_xla.sync()
    penalty = FSDP(Tiny())   # a gradient penalty: its graph would read freed parameters
    x = torch.ones(2, 4).to(torch_xla.device()).requires_grad_()

    def grad_penalty():
        gx, = torch.autograd.grad(penalty(x).square().sum(), x, create_graph=True)
        gx.square().sum().backward()
    out["create_graph"] = error_of(grad_penalty)
    out["step_after_create_graph"] = error_of(lambda: penalty(x).sum().backward())
    torch_xla.sync()
    _never_synced(out)
    full_optimizer_state(out)
    _grouping_misuses(out)
    _reduced_gradient_misuses(out)
    _conversions(out)
    return out


def _never_synced(out):
    """A loop without torch_xla.sync(): told once, at its third step (see [Note: a loop
    without torch_xla.sync()]). Six steps: another rank's sync before its own loop may land
    between two of this rank's, and restart the count once."""
    import warnings
    import torch_xla
    import torch_xla.debug.metrics as metrics
    from xla_fsdp import FSDP
    x = torch.ones(2, 4).to(torch_xla.device())
    out["never_synced"] = []
    # told by the momentum still pending, then (no tensor state) by torch_xla's sync count;
    # a loop that syncs each step, calling metrics.clear_all() too, is not told
    for momentum, sync in ((0.9, False), (0.0, False), (0.9, True)):
        model = FSDP(Tiny())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(6):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                if sync:
                    torch_xla.sync()
                    metrics.clear_all()
        out["never_synced"].append([str(w.message) for w in seen
                                    if "torch_xla.sync()" in str(w.message)])
        torch_xla.sync()


def _conversions(out):
    """torch's module conversions on a wrapped model: the ones that change nothing for the
    shards pass and keep them (an offloaded model moved to its device keeps its host
    shards), the others are refused with the unit and parameter named and change nothing
    (see [Note: converting a wrapped model])."""
    import torch_xla
    from xla_fsdp import FSDP
    device = torch_xla.device()
    for offload in (False, True):
        model = FSDP(nn.Sequential(FSDP(Tiny(), offload_optimizer=offload), Tiny()),
                     offload_optimizer=offload)
        before = list(model.parameters())
        places = [(p.device, p.dtype) for p in before]
        kept = []
        for name, convert in (("to_device", lambda: model.to(device)),
                              ("float", model.float),
                              ("to_empty", lambda: model.to_empty(device=device)),
                              ("half", model.half), ("cpu", model.cpu),
                              ("double", model.double), ("to_bf16", lambda: model.to(
                                  torch.bfloat16))):
            out[f"{name}_offload_{offload}"] = error_of(convert)
            kept.append(list(model.parameters()) == before and
                        [(p.device, p.dtype) for p in model.parameters()] == places)
        out[f"conversions_keep_shards_offload_{offload}"] = every(kept)
        out[f"shard_devices_offload_{offload}"] = sorted({str(p.device) for p in before})
    # a nested unit is named by its path, its parameter as the unwrapped model names it
    nested = FSDP(nn.Sequential(FSDP(Tiny()), FSDP(Tiny())))
    out["nested_half"] = error_of(nested.half)
    # a module inside a unit, converted alone: its placeholders stand for the shards
    inside = FSDP(nn.Sequential(FSDP(Tiny()), Tiny()))
    out["inside_conversions"] = [error_of(lambda: inside.module[1].to(torch.bfloat16)),
                                 error_of(inside.module[0].module.lin.half),
                                 error_of(inside.module[1].float)]


def _reduced_gradient_misuses(out):
    """What is done to gradients between FSDP's reduce-scatter and the step, refused at the
    first step when it trains wrong (a data-parallel all-reduce on top; clipping by each
    rank's own norm, as accelerate falls back to for a model it was not given) and let
    through when it does not."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    from xla_fsdp import FSDP

    def step_after(change, scanned=False, scaler=None):
        if scanned:   # gradients reduced inside the backward loop and around it
            model = FSDP(Stack())
        else:
            model = FSDP(nn.Sequential(FSDP(Tiny()), Tiny()))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.ones(2, 4).to(torch_xla.device())).sum()
        (scaler.scale(loss) if scaler else loss).backward()
        change(model, opt)
        result = error_of(lambda: scaler.step(opt) if scaler else opt.step())
        torch_xla.sync()
        return result
    params = lambda m: list(m.parameters())  # noqa: E731

    def clip_locally(m, opt):
        # a library's own clipping, as torch's (which is refused where it is called, see
        # test_misuse_errors): the norm of this rank's slices scales its gradients
        grads = [p.grad for p in params(m)]
        total = torch.stack([g.norm() for g in grads]).norm()
        for g in grads:
            g.mul_(torch.clamp(1e-3 / (total + 1e-6), max=1.0))
    # accelerate's data-parallel all-reduce on XLA (xm.reduce_gradients is refused where
    # it is called)
    out["grads_all_reduced"] = step_after(lambda m, opt: xm.all_reduce(
        xm.REDUCE_SUM, [p.grad for p in params(m)], scale=0.5))
    out["grads_clipped_locally"] = step_after(clip_locally)
    # under GradScaler, whose step syncs before it reads its flags: audited before that sync
    out["grads_all_reduced_scaled"] = step_after(lambda m, opt: xm.all_reduce(
        xm.REDUCE_SUM, [p.grad for p in params(m)], scale=0.5),
        scaler=torch.amp.GradScaler("xla"))
    scaler = torch.amp.GradScaler("xla")   # unscaled explicitly, then clipped, then stepped
    out["clipped_after_unscale"] = step_after(
        lambda m, opt: (scaler.unscale_(opt), clip_locally(m, opt)), scaler=scaler)
    out["scanned_clipped_locally"] = step_after(clip_locally, scanned=True)
    out["scanned_clipped_globally"] = step_after(lambda m, opt: m.clip_grad_norm_(1e-3),
                                                 scanned=True)

    def allowed(m, opt):
        m.clip_grad_norm_(1e-3)
        torch.nn.utils.clip_grad_value_(params(m), 1e-4)
        for p in params(m):
            p.grad.add_(p, alpha=0.01)
    out["grads_clipped_globally"] = step_after(allowed)


def _grouping_misuses(out):
    import torch_xla
    from xla_fsdp import FSDP
    from xla_fsdp.wrap import always_wrap_policy
    x = torch.ones(2, 4).to(torch_xla.device())
    out["group_empty"] = error_of(lambda: FSDP([]))
    twice = Tiny()
    out["group_twice"] = error_of(lambda: FSDP([twice.lin, twice.lin]))
    out["group_policy"] = error_of(lambda: FSDP([Tiny(), Tiny()],
                                              auto_wrap_policy=always_wrap_policy))
    grouped = Tiny()
    FSDP([grouped.lin])
    out["group_again"] = error_of(lambda: FSDP([grouped.lin]))
    outer = Tiny()
    FSDP([outer, outer.lin])
    out["group_nested"] = error_of(lambda: FSDP(nn.Sequential(outer)))
    a, b = Tiny(), Tiny()
    unplaced = FSDP([a.lin, b.lin])
    out["group_unplaced"] = error_of(lambda: a(x))
    out["group_called"] = error_of(lambda: unplaced(x))
    unit = FSDP(Tiny())
    out["prefetch_plain_module"] = error_of(lambda: unit.set_modules_to_forward_prefetch([Tiny()]))
    out["prefetch_self"] = error_of(lambda: unit.set_modules_to_backward_prefetch([unit]))


class Lamb(torch.optim.Optimizer):
    """LAMB's trust ratio, as libraries write it: the step scaled by the norms of the
    parameter and of its update (a statistic of the whole tensor)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for param_group in self.param_groups:
            for p in param_group["params"]:
                if p.grad is not None:
                    ratio = p.norm() / (p.grad.norm() + 1e-6)
                    p.add_(p.grad * ratio, alpha=-param_group["lr"])


# elementwise: their update is read and let through ([Note: auditing an optimizer's update])
ELEMENTWISE = ("Adamax", "NAdam", "RAdam", "Rprop", "ASGD", "Adagrad", "RMSprop", "Adadelta")


def whole_tensor_optimizers(rank, directory):
    """Optimizers whose update reads the whole tensor on shards: refused at the first step
    before any update, on both layouts; accepted with allow_per_shard_statistics, whose
    per-rank state then saves as per-rank files only, refused on every rank elsewhere (see
    [Note: optimizers that read the whole tensor]). An optimizer whose state dict hook
    renumbers its tensors: refused by every save on every rank, before writing."""
    import os
    import torch_xla
    from xla_fsdp import FSDP, allow_per_shard_statistics
    from xla_fsdp.checkpoint import load_sharded, save_consolidated, save_dcp, save_sharded
    from xla_fsdp.checkpoint.consolidate.library import consolidate_checkpoint_files
    x = torch.ones(2, 4).to(torch_xla.device())
    out = {}
    for dim0 in (False, True):
        model = FSDP(nn.Sequential(FSDP(Tiny(), shard_param_on_dim_0=dim0), Tiny()),
                     shard_param_on_dim_0=dim0)
        # Muon takes matrices only: flat shards are not (torch refuses them itself)
        for name in ("Adafactor", "Muon") if dim0 else ("Adafactor",):
            params = [p for p in model.parameters() if p.dim() == 2] if name == "Muon" \
                else model.parameters()
            opt = getattr(torch.optim, name)(params, lr=0.01)
            model(x).sum().backward()
            before = [p.detach().cpu().clone() for p in model.parameters()]
            out[f"{name}_{dim0}"] = error_of(opt.step)
            out[f"{name}_{dim0}_unchanged"] = every(torch.equal(a, p.detach().cpu()) for a, p in
                                                    zip(before, model.parameters(), strict=True))
            opt.zero_grad()
        # not known by name: its first update is read, put back and refused
        opt = Lamb(model.parameters())
        model(x).sum().backward()
        before = [p.detach().cpu().clone() for p in model.parameters()]
        out[f"Lamb_{dim0}"] = (error_of(opt.step), every(
            torch.equal(a, p.detach().cpu()) for a, p in pairs(before, model.parameters())))
        opt.zero_grad()
    out["elementwise"] = []
    for name in ELEMENTWISE:
        opt = getattr(torch.optim, name)(model.parameters())
        model(x).sum().backward()
        out["elementwise"].append(error_of(opt.step))
        opt.zero_grad()
        torch_xla.sync()
    # one step: later ones trace rank-specific graphs here (docs/launcher.md, limits)
    model = FSDP(nn.Sequential(FSDP(Tiny(), shard_param_on_dim_0=True), Tiny()),
                 shard_param_on_dim_0=True)
    opt = allow_per_shard_statistics(torch.optim.Adafactor(model.parameters(), lr=0.01))
    model(x).sum().backward()
    out["allowed"] = error_of(opt.step)
    torch_xla.sync()
    prefix = os.path.join(directory, "ckpt")
    save_sharded(prefix, model, opt)
    out["per_rank_load"] = error_of(lambda: load_sharded(prefix, model, opt))
    out["consolidated"] = error_of(lambda: save_consolidated(
        os.path.join(directory, "full.pth"), model, opt))
    out["dcp"] = error_of(lambda: save_dcp(os.path.join(directory, "dcp"), model, opt))
    if rank == 0:
        out["offline"] = error_of(lambda: consolidate_checkpoint_files(
            prefix, "_rank-*-of-*.pth", save_path=os.path.join(directory, "offline.pth")))
    # a state dict hook that renumbers the tensors would give one's state another's name
    hooked = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked.register_state_dict_post_hook(lambda _, saved: saved["param_groups"][0].update(
        params=saved["param_groups"][0]["params"][::-1]))
    renumbered = os.path.join(directory, "renumbered")
    out["renumbered"] = [error_of(lambda: save(renumbered + tail, model, hooked))
                         for save, tail in ((save_sharded, ""), (save_consolidated, ".pth"),
                                            (save_dcp, "_dcp"))]
    out["renumbered_files"] = [n for n in os.listdir(directory) if n.startswith("renumbered")]
    return out


def test_optimizers_that_read_the_whole_tensor(tmp_path):
    results = launch(whole_tensor_optimizers, (str(tmp_path),), num_devices=2)
    out = results[0]
    for name, reads, dim0 in (("Adafactor", "row and column means", False),
                              ("Adafactor", "row and column means", True),
                              ("Muon", "the whole matrix", True)):
        message = out[f"{name}_{dim0}"]
        assert message.startswith(f"RuntimeError: {name}.step(): {name}'s update reads "
                                  f"{reads}"), message
        assert "allow_per_shard_statistics" in message and "Refused before" in message
        assert out[f"{name}_{dim0}_unchanged"]
    for dim0 in (False, True):
        message, unchanged = out[f"Lamb_{dim0}"]
        assert message.startswith("RuntimeError: Lamb.step(): Lamb's update of ") and \
            "reads more of a tensor than each element" in message and \
            "The update was put back" in message and unchanged, out[f"Lamb_{dim0}"]
    assert out["elementwise"] == ["no error"] * len(ELEMENTWISE), out["elementwise"]
    assert out["allowed"] == "no error" and out["per_rank_load"] == "no error"
    for rank_out in (results[0], results[1]):   # refused on every rank: no rank waits
        for case in ("consolidated", "dcp"):
            message = rank_out[case]
            assert message.startswith("CheckpointError: ") and "optimizer state 'row_var' " \
                "has shape" in message and "per-rank files (save_sharded) keep" in message, message
    assert "optimizer state 'row_var' has shape" in out["offline"], out["offline"]
    assert "ckpt_rank-00000000-of-00000002.pth" in out["offline"], out["offline"]
    for rank_out in (results[0], results[1]):
        for message in nonempty(rank_out["renumbered"], "saves"):
            assert message.startswith("CheckpointError: SGD.state_dict() numbers the tensors "
                                      "of its param groups otherwise"), message
    assert out["renumbered_files"] == [], out["renumbered_files"]


def test_misuse_errors():
    out = launch(misuses, num_devices=2)[0]
    assert "already wrapped" in out["double_wrap"]
    assert "ModuleList" in out["module_list"] and "no forward()" in out["module_list"]
    assert out["scan_unknown_option"].startswith("TypeError: ScannedLayers") and \
        "['reshard_after_fwd']" in out["scan_unknown_option"]
    assert "already wrapped" in out["scan_twice"]
    # named only when not the default; compute_dtype applies
    assert out["scan_unit_options"] == [
        "ScannedLayers (2 x Tiny) ignores reshard_after_forward=False, "
        "zero_missing_gradients=True: a stack's scan gathers, frees and reduces one layer at a "
        "time, whatever a whole unit's schedule says"], out["scan_unit_options"]
    assert "TypeError" in out["int_param"] and "'lin.steps'" in out["int_param"]
    assert "compute_dtype" in out["dtype"] and "int8" in out["dtype"]
    assert out["added_after_first_forward"].startswith(
        "ValueError: FSDP unit around Sequential: parameters were added to the model after it "
        "was wrapped") and "1.lin.bias" in out["added_after_first_forward"], \
        out["added_after_first_forward"]
    nested_unit, inside, leaf, unchanged = out["load_below_root"]
    assert nested_unit.startswith("ValueError: FSDP unit around Tiny: load_state_dict() got an "
                                  "unwrapped module's state dict") and \
        "only the root loads one" in nested_unit, nested_unit
    for message, key in (inside, "lin.weight"), (leaf, "weight"):
        assert message.startswith(f"ValueError: load_state_dict() got '{key}', a parameter that "
                                  f"the FSDP unit around Sequential shards"), message
    assert unchanged
    assert out["groups_no_rank"] == [1, 2], out["groups_no_rank"]   # rank 0 is second
    assert "every rank 0..1" in out["groups_cover"]
    assert out["groups_same"] == "no error", out["groups_same"]
    for message in nonempty(out["groups_mixed"], "mixed shardings"):
        assert message.startswith("ValueError: FSDP unit around Sequential has sharding_groups="), \
            message
        assert "the unit around Tiny inside it" in message and "the same ranks" in message, message
    assert "'1.lin.weight' of Sequential is shared with 'lin.weight' of the unit around " \
        "Tiny, which sharded it first" in out["tied_across_units"], out["tied_across_units"]
    assert "lin.weight was frozen (requires_grad=False) during a no_sync() accumulation " \
        "and still is" in out["frozen_mid_accumulation"], out["frozen_mid_accumulation"]
    refused, after = out["clip_mid_accumulation"]
    assert refused.startswith("RuntimeError: clip_grad_norm_ inside a no_sync() accumulation "
                              "(1.lin.weight, 1.lin.bias, lin.weight, ...: micro-batches not "
                              "reduced yet)") and after == "no error", \
        out["clip_mid_accumulation"]
    assert "a param group with weight decay holds no matrix, while the group without it " \
        "holds flat shards of matrices (lin.weight)" in out["decay_by_dim"], out["decay_by_dim"]
    assert out["own_scalars"] == "no error", out["own_scalars"]
    momentum, plain, synced = out["never_synced"]
    for told in (momentum, plain):
        assert len(told) == 1 and told[0].startswith(
            "SGD.step() ran 3 times without a torch_xla.sync()"), told
    assert synced == [], synced
    three, one = out["other_layout_state"]
    assert "has shape (3,), not its shard's" in three and "shape (1,), not its" in one, \
        out["other_layout_state"]
    alone, reduced = out["free_parameter"]
    assert "parameter 2 (shape (1,)) is in no FSDP unit" in alone and reduced == "no error", \
        out["free_parameter"]
    refused, unchanged = out["full_optimizer_state"]
    assert "the optimizer state 'momentum_buffer' of lin.weight has the whole parameter's " \
        "shape (4, 4), not its shard's" in refused and unchanged, out["full_optimizer_state"]
    assert out["retried"][0] != "no error" and out["retried"][1] == "no error", out["retried"]
    assert every("Create the optimizer after wrapping" in out[k] and "lin.weight" in out[k]
                 for k in ("optimizer_before_wrap", "inner_module_group"))
    assert "for a group of one module's parameters" in out["inner_module_group"]
    assert "Call optimizer.step() instead" in out["xm_optimizer_step"]
    assert "would clip each rank's slice by the norm of that slice alone" in \
        out["torch_clip_after_sync"], out["torch_clip_after_sync"]
    assert "Call optimizer.step() instead" in out["reduce_gradients"], out["reduce_gradients"]
    assert out["torch_clip_two_calls"].startswith(
        "RuntimeError: torch.nn.utils.clip_grads_with_norm_ over FSDP shards"), \
        out["torch_clip_two_calls"]
    assert abs(out["torch_clip_plain"] - 48 ** 0.5) < 1e-5, out["torch_clip_plain"]
    assert "root FSDP unit" in out["clip_nested"]
    assert every("parameter 'lin.weight' was changed in place through its module attribute"
                 in e for e in out["placeholder_write_saved"] + [out["placeholder_write"]]), \
        (out["placeholder_write_saved"], out["placeholder_write"])
    for key, op in (("placeholder_clamp", "clamp_"), ("read_outside_unit", "pow")):
        assert out[key].startswith(f"RuntimeError: {op}() read parameter 'lin.weight' of the "
                                   f"FSDP unit around Tiny outside the unit's forward"), out[key]
    assert out["attention_out_proj"].startswith(
        "ValueError: FSDP unit around Attends: the nn.MultiheadAttention at 'attn' has its "
        "out_proj wrapped in a unit of its own"), out["attention_out_proj"]
    for message in nonempty(out["written_while_held"], "forwards"):
        assert message.startswith("RuntimeError: ClampsItsWeight: parameter 'lin.weight' was "
                                  "changed in place while the unit held its full value"), message
    assert out["create_graph"].startswith("RuntimeError: FSDP unit around Tiny: a backward "
                                          "with create_graph=True"), out["create_graph"]
    assert out["step_after_create_graph"] == "no error", out["step_after_create_graph"]
    assert "['lin.weight', 'lin.bias'] on the meta device" in out["init_fn_leaves_meta"]
    assert "empty list" in out["group_empty"]
    assert "same module twice" in out["group_twice"]
    assert "auto_wrap_policy" in out["group_policy"] and "list of modules" in out["group_policy"]
    assert "Linear is already grouped" in out["group_again"]
    assert "'0' with '0.lin', which is inside it" in out["group_nested"]
    assert "grouping (Linear, Linear) was never attached" in out["group_unplaced"]
    assert "is not called itself" in out["group_called"]
    assert "got Tiny, which is not wrapped in FSDP" in out["prefetch_plain_module"]
    assert "cannot prefetch itself (Tiny)" in out["prefetch_self"]
    for case, what in (("grads_all_reduced", "all-reduced across ranks that hold different"),
                       ("grads_all_reduced_scaled", "all-reduced across ranks that hold"),
                       ("grads_clipped_locally", "scaled by a reduction of this rank's slices")):
        assert "SGD.step(): the FSDP gradients of 1.lin.weight" in out[case], out[case]
        assert what in out[case] and "refused before any update" in out[case], out[case]
    assert "clip_grad_norm_ (or a library's clipping)" in out["grads_clipped_locally"]
    assert "scaled by a reduction of this rank's slices" in out["clipped_after_unscale"], \
        out["clipped_after_unscale"]
    assert out["grads_clipped_globally"] == "no error"
    assert "scaled by a reduction of this rank's slices" in out["scanned_clipped_locally"]
    assert out["scanned_clipped_globally"] == "no error"
    for offload in (False, True):
        for passes in ("to_device", "float", "to_empty"):
            assert out[f"{passes}_offload_{offload}"] == "no error", passes
        for refused, dtype in (("half", "float16"), ("cpu", None), ("double", "float64"),
                               ("to_bf16", "bfloat16")):
            message = out[f"{refused}_offload_{offload}"]
            assert message.startswith("ValueError: FSDP unit 'Sequential': converting the "
                                      "wrapped model would take '1.lin.weight' from "
                                      "torch.float32 on xla:0 to torch."), message
            assert f"to torch.{dtype or 'float32'} on {'xla:0' if dtype else 'cpu'}." in message
            assert "Nothing in this unit was converted" in message, message
        assert out[f"conversions_keep_shards_offload_{offload}"]
        assert out[f"shard_devices_offload_{offload}"] == (["cpu"] if offload else ["xla:0"])
    to_bf16, half, to_float = out["inside_conversions"]
    for message, unit, name in [(to_bf16, "Sequential", "1.lin.weight"),
                                (half, "Tiny", "lin.weight")]:
        assert message.startswith(f"ValueError: FSDP unit '{unit}': converting the wrapped model "
                                  f"would take '{name}' from torch.float32"), message
    assert to_float == "no error", to_float
    assert out["nested_half"].startswith("ValueError: FSDP unit 'Tiny' at '0': converting the "
                                         "wrapped model would take '0.lin.weight'"), \
        out["nested_half"]
