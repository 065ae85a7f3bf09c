"""The parity settings: the same model trained unsharded on one device (the reference) and
wrapped in FSDP at N ranks, each rank on its slice of the global batch, step by step; and
the comparison of the two.

The bounds are the suite's ([Note: parity bounds] in ``bounds.py``); a low-precision
setting's reference computes in its dtype (``low_precision_reference``).
"""
import contextlib
import functools

import torch

from .bounds import PARAM, loss_problems, parameter_problems, precision
from .checks import pairs
from .models import (GLOBAL_BATCH, STEPS, TIED_KINDS, Block, batch, build_model,
                     checkpoint_forward, forward_in, loss_fn)

ADAM_LR = 1e-3

SETTINGS = {
    # name: (model kind, fsdp kwargs, optimizer, extra)
    "nested": ("net", {}, "sgd", {}),
    "flattened": ("net", {"flatten_parameters": True}, "sgd", {}),
    "flattened_coalesced": ("net", {"flatten_parameters": True,
                                    "coalesce_all_gather_ops": True}, "sgd", {}),
    # what a TPU gets at the defaults: row-block shards, one gather per unit ([Note:
    # defaults that depend on the hardware]), and no collective token ([Note: no collective
    # token on a TPU]). "hardware" settings run in a launch of their own, whose units are
    # built as for that hardware
    "tpu_defaults": ("net", {}, "sgd", {"hardware": "TPU"}),
    "tpu_adamw_no_sync_clip": ("net", {}, "adamw", {"hardware": "TPU", "micro": 2,
                                                    "no_sync": True, "clip": 0.05}),
    "tpu_scanned_bf16": ("stack", {"compute_dtype": torch.bfloat16, "fp32_reduce_scatter": True},
                         "sgd", {"hardware": "TPU", "scan": True}),
    "adamw": ("net", {}, "adamw", {}),
    "frozen": ("net", {}, "sgd", {"freeze": ("b1.up", "inp.bias")}),
    "flattened_frozen": ("net", {"flatten_parameters": True}, "sgd",
                         {"freeze": ("b1.up", "inp.bias")}),
    "bucketed": ("net", {"reduce_scatter_bucket_size_mb": 1}, "sgd", {}),
    # every group reduced at the end of backward, in group order (zeros where a rank has
    # no gradient); with every gradient present it must train exactly as the default
    "zero_missing": ("net", {"zero_missing_gradients": True}, "sgd", {}),
    "tied": ("tied", {}, "sgd", {}),
    # a size policy that would wrap the tied embedding alone, apart from its head ([Note: a
    # tie is not split by a policy]): the tie stays with the root, the linears get units
    "tied_size_policy": ("tied", {}, "sgd", {"size_policy": 1000}),
    "accumulate": ("net", {}, "sgd", {"micro": 2}),
    "accumulate_no_sync": ("net", {}, "sgd", {"micro": 2, "no_sync": True}),
    "clip": ("net", {}, "sgd", {"clip": 0.05}),
    "bf16": ("net", {"compute_dtype": torch.bfloat16, "fp32_reduce_scatter": True}, "sgd", {}),
    # torch.autocast around the forward instead of compute_dtype, as torch_xla's AMP recipe
    # does: every linear (the weight-reading one FSDP patches in too) in bf16 both ways
    # ([Note: the patched linear under autocast])
    "autocast_bf16": ("net", {}, "adamw", {"autocast": torch.bfloat16}),
    "checkpointed": ("net", {}, "sgd", {"auto_wrap_checkpoint": True}),
    # bf16 attention, sdpa and eager, in checkpointed units: their matmuls in bf16, forward
    # and recompute alike (see [Note: attention under a low-precision compute_dtype])
    "attention_bf16_checkpointed": ("attention", {"compute_dtype": torch.bfloat16,
                                                  "fp32_reduce_scatter": True}, "sgd",
                                    {"auto_wrap_checkpoint": True}),
    # torch.utils.checkpoint, as Hugging Face's gradient_checkpointing_enable() applies it
    # (reentrant, inside each unit) and as torch's checkpoint_wrapper does (non-reentrant,
    # around each unit, so the unit's forward runs again inside backward)
    "torch_checkpoint_inside": ("net", {}, "sgd", {"torch_checkpoint": "inside"}),
    "torch_checkpoint_around": ("net", {}, "sgd", {"torch_checkpoint": "around"}),
    # BatchNorm normalises with its batch's statistics, so every rank takes the whole batch
    "batchnorm": ("bn", {}, "sgd", {"groups": 1}),
    # under bf16 compute BatchNorm runs in float32 and its statistics stay float32
    "batchnorm_bf16": ("bn", {"compute_dtype": torch.bfloat16, "fp32_reduce_scatter": True},
                       "sgd", {"groups": 1}),
    # ... and reduced in bf16 beside the bf16 layers in one bucket, each with its own scale
    "batchnorm_bf16_bucketed": ("bn", {"compute_dtype": torch.bfloat16,
                                       "reduce_scatter_bucket_size_mb": 1},
                                "sgd", {"groups": 1, "worlds": (1, 2, 4)}),
    "sharding_groups": ("net", {}, "sgd", {"groups": 2}),
    # hybrid sharding: groups of two are replicas that see different data, their gradients
    # averaged across groups
    "hsdp": ("net", {"replicate_across_groups": True}, "sgd", {"groups": 2, "replicas": True}),
    # ...in bf16, the replicas' gradients averaged in bf16 (see [Note: pinned bf16
    # all-reduce] for the virtual devices)
    "hsdp_bf16": ("net", {"replicate_across_groups": True, "compute_dtype": torch.bfloat16},
                  "sgd", {"groups": 2, "replicas": True}),
    # GradScaler (unscaled before clipping) and an optimizer that reads gradients on the host:
    # both read after one sync of the step (see step_reads in the package)
    "scaled_guarded_clip": ("net", {}, "sgd_guarded", {"scaler": True, "clip": 0.05}),
    # the same reading optimizer alone: learnt at its first step, later steps synced before
    # they start and their update numbered through stand-ins ([Note: an update that runs as a
    # program of its own])
    "guarded": ("net", {}, "sgd_guarded", {}),
    # every explicit control at once: grouped units, prefetching both ways, per-unit
    # resharding (b1 keeps its parameters after backward, so each step's optimizer update
    # must make it gather again), unshard() before each step
    "controls": ("net", {}, "sgd_foreach", {"controls": True}),
    "tied_grouped": ("tied", {}, "sgd", {"controls": True}),
    # the blocks as one ScannedLayers unit: a while loop over stacked shards
    "scanned": ("stack", {}, "sgd", {"scan": True, "clip": 0.05}),
    "scanned_flat_bf16": ("stack", {"flatten_parameters": True, "compute_dtype": torch.bfloat16,
                                    "fp32_reduce_scatter": True}, "sgd", {"scan": True}),
    # with prefetch: each body gathers the next layer beside the current one's compute
    "scanned_dim0_adamw_prefetch": ("stack", {"shard_param_on_dim_0": True}, "adamw",
                                    {"scan": True, "prefetch": True}),
    # a frozen parameter must be frozen in every layer (one stacked shard holds them all)
    "scanned_groups_frozen": ("stack", {}, "sgd", {
        "scan": True, "groups": 2,
        "freeze": ("layers.0.up", "layers.1.up", "layers.2.up", "inp.bias")}),
    # torch_xla's loop turns booleans into int64, where ~mask is always true
    "scanned_masked": ("stack_masked", {}, "adamw", {"scan": True}),
    # the optimizer on the host: its state, the float32 shards and their gradients there,
    # stepped by PyTorch's CPU kernels against the reference's XLA ones. Two synchronised
    # micro-batches add to the host gradient; no_sync accumulates on the device first.
    # At N = 1, 2 and 4 (the goal), and the first also at 8: five settings at 8
    # ranks would take a minute of the suite's budget
    "offload_adamw_clip_accumulate": ("net", {"offload_optimizer": True}, "adamw",
                                      {"micro": 2, "clip": 0.05}),
    "offload_momentum_no_sync": ("net", {"offload_optimizer": True}, "sgd",
                                 {"micro": 2, "no_sync": True, "worlds": (1, 2, 4)}),
    # bf16 gradients leave the device as reduced, in bf16, and become float32 on the host
    "offload_bf16": ("net", {"offload_optimizer": True, "compute_dtype": torch.bfloat16},
                     "adamw", {"worlds": (1, 2, 4)}),
    "offload_scanned_frozen": ("stack", {"offload_optimizer": True,
                                         "flatten_parameters": True}, "sgd", {
        "scan": True, "freeze": ("layers.0.up", "layers.1.up", "layers.2.up", "inp.bias"),
        "worlds": (1, 2, 4)}),
    # torch_xla's documented nesting: each block moved and wrapped, then the root wrapped
    # around the model moved again, whose .to() must leave the blocks' host shards alone
    # ([Note: converting a wrapped model])
    "offload_torch_xla_recipe": ("net", {"offload_optimizer": True}, "sgd",
                                 {"torch_xla_recipe": True, "worlds": (2, 4)}),
    # the vocabulary tables in row blocks, never gathered ([Note: vocabulary-parallel
    # tables]): 50 rows, padded at N = 4 and 8; the tied table in the root beside wrapped
    # blocks, clipped over every shard; an untied head in one flattened unit, accumulated
    # under no_sync; bf16 lookups and logits
    "vocab_parallel_tied_clip": ("tied", {"vocab_parallel": True}, "adamw", {"clip": 0.05}),
    "vocab_parallel_untied_no_sync": ("tied", {"vocab_parallel": True,
                                               "flatten_parameters": True}, "sgd",
                                      {"untie": True, "micro": 2, "no_sync": True,
                                       "one_unit": True}),
    "vocab_parallel_bf16": ("tied", {"vocab_parallel": True, "compute_dtype": torch.bfloat16,
                                     "fp32_reduce_scatter": True}, "sgd", {}),
    "offload_groups_frozen": ("net", {"offload_optimizer": True}, "sgd_foreach",
                              {"groups": 2, "freeze": ("b1.up", "inp.bias"), "worlds": (4,)}),
}


class GuardedSGD(torch.optim.Optimizer):
    """SGD that reads on the host whether each gradient is finite before applying it, as a
    NaN guard does: a step that reads values ([Note: a host read runs the graph behind it
    again])."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if not bool(torch.isfinite(p.grad).all()):
                        raise FloatingPointError("a gradient is not finite")
                    p.add_(p.grad, alpha=-group["lr"])


def make_optimizer(name, params):
    if name == "sgd_guarded":
        return GuardedSGD(params, lr=0.1)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    # torch_xla's foreach kernels do not bump the version counter of what they update
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=(name == "sgd_foreach"))


def wrap(model, kind, fsdp_kwargs, extra, world):
    from xla_fsdp import FSDP, checkpoint_module
    from xla_fsdp.wrap import transformer_auto_wrap_policy
    kw = dict(fsdp_kwargs, pin_layout_in_collective_ops=True)
    if extra.get("groups", 0) > 1:
        size = extra["groups"]
        groups = [list(range(i, i + size)) for i in range(0, world, size)]
        import torch_xla.runtime as xr
        me = xr.global_ordinal()
        kw.update(sharding_groups=groups, sharding_rank=me % size, sharding_world_size=size)
    if extra.get("controls"):
        return _wrap_with_controls(model, kind, kw)
    if extra.get("scan"):
        from xla_fsdp import ScannedLayers
        model.layers = ScannedLayers(model.layers,
                                     prefetch_next_layer=extra.get("prefetch", False), **kw)
        return FSDP(model, **kw)
    if extra.get("size_policy"):
        from xla_fsdp.wrap import size_based_auto_wrap_policy
        return FSDP(model, auto_wrap_policy=functools.partial(
            size_based_auto_wrap_policy, min_num_params=extra["size_policy"]), **kw)
    if extra.get("auto_wrap_checkpoint"):
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        return FSDP(model, auto_wrap_policy=policy,
                    auto_wrapper_callable=lambda m, *a, **k: FSDP(checkpoint_module(m), *a, **k),
                    **kw)
    if extra.get("torch_checkpoint") == "inside":
        model.b1 = FSDP(checkpoint_forward(model.b1), **kw)
        model.b2 = FSDP(checkpoint_forward(model.b2), **kw)
        return FSDP(model, **kw)
    if extra.get("torch_xla_recipe"):
        import torch_xla
        device = torch_xla.device()
        model.b1 = FSDP(model.b1.to(device), **kw)
        model.b2 = FSDP(model.b2.to(device), **kw)
        return FSDP(model.to(device), **kw)
    if extra.get("one_unit"):
        return FSDP(model, **kw)
    model.b1 = FSDP(model.b1, **kw)
    model.b2 = FSDP(model.b2, **kw)
    if extra.get("torch_checkpoint") == "around":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper)
        model.b1, model.b2 = checkpoint_wrapper(model.b1), checkpoint_wrapper(model.b2)
    return FSDP(model, **kw)


def _wrap_with_controls(model, kind, kw):
    from xla_fsdp import FSDP
    if kind == "tied":  # the tied embedding and head in one unit
        ends = FSDP([model.emb, model.head], **kw)
    else:
        ends = FSDP([model.inp, model.head], **dict(kw, coalesce_all_gather_ops=True))
    model.b1 = FSDP(model.b1, **kw)
    model.b2 = FSDP(model.b2, **kw)
    root = FSDP(model, **kw)
    assert not root.shard_groups, "the grouped unit, not the root, holds the ends' parameters"
    ends.set_modules_to_forward_prefetch([model.b1])
    model.b1.set_modules_to_forward_prefetch([model.b2])
    ends.set_modules_to_backward_prefetch([model.b2])
    model.b2.set_modules_to_backward_prefetch([model.b1])
    model.b2.set_reshard_after_forward(False)
    model.b1.set_reshard_after_backward(False)
    root._test_unshard_each_step = ends
    return root


def full_parameters(model):
    """{name in the unwrapped model: full value on CPU} of a wrapped model's parameters."""
    from xla_fsdp._sharding.names import clean_name
    buffers = {clean_name(k) for k, _ in model.named_buffers()}
    return {k: v.float() for k, v in model.full_state_dict(rank0_only=False).items()
            if k not in buffers}


def low_precision_reference(name):
    """The compute dtype the reference of setting ``name`` runs in (``forward_in``), or None:
    float32, for float32 settings and for attention, which a low-precision unit computes its
    own way ([Note: attention under a low-precision compute_dtype])."""
    kind, kwargs, _, _ = SETTINGS[name]
    return None if kind == "attention" else kwargs.get("compute_dtype")


def train(rank, names, sharded):
    from xla_fsdp._sharding.names import clean_name
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = torch_xla.device()
    world = xr.world_size() if sharded else 1
    hardware = {SETTINGS[n][3].get("hardware") for n in names}
    if sharded and hardware != {None}:
        assert len(hardware) == 1, f"one launch builds units for one hardware: {names}"
        from xla_fsdp._xla.hardware import plan_for
        plan_for(hardware.pop())
    results = {}
    for name in names:
        kind, fsdp_kwargs, opt_name, extra = SETTINGS[name]
        reference_dtype = None if sharded else low_precision_reference(name)
        torch.manual_seed(0)
        model = build_model(kind)
        tied = kind in TIED_KINDS and not extra.get("untie")
        if extra.get("untie"):
            model.head.weight = torch.nn.Parameter(model.emb.weight.detach() * 0.5)
        for prefix in extra.get("freeze", ()):
            for pname, p in model.named_parameters():
                if pname.startswith(prefix):
                    p.requires_grad_(False)
        # data-parallel replicas: within a sharding group the batch is split; every group
        # trains on the whole global batch
        split = (world if extra.get("replicas") else min(extra.get("groups", world), world)
                 ) if sharded else 1
        part = rank % split if sharded else 0
        if sharded:
            model = wrap(model, kind, fsdp_kwargs, extra, world)
        else:
            model = model.to(device)
            if tied:
                model.head.weight = model.emb.weight  # moving to XLA unties
        opt = make_optimizer(opt_name, [p for p in model.parameters() if p.requires_grad])
        micro = extra.get("micro", 1)
        # a power of two: scaling and unscaling float32 gradients is exact
        scaler = torch.amp.GradScaler("xla", init_scale=2.0 ** 8) if extra.get("scaler") else None
        losses, norms = [], []
        for step in range(STEPS):
            x, y = batch(kind, step)
            local = GLOBAL_BATCH // split
            x, y = x[part * local:(part + 1) * local], y[part * local:(part + 1) * local]
            opt.zero_grad()
            if sharded and extra.get("controls"):
                model._test_unshard_each_step.unshard()
            total = 0.0
            for m in range(micro):
                n = local // micro
                xs, ys = x[m * n:(m + 1) * n].to(device), y[m * n:(m + 1) * n].to(device)
                skip_sync = sharded and extra.get("no_sync") and m < micro - 1
                autocast = extra.get("autocast")
                with (model.no_sync() if skip_sync else contextlib.nullcontext()):
                    with torch.autocast("xla", dtype=autocast, enabled=autocast is not None):
                        out = forward_in(model, xs, reference_dtype)
                    loss = loss_fn(kind, out, ys) / micro
                    (scaler.scale(loss) if scaler else loss).backward()
                total = total + loss.detach()
            if "clip" in extra:
                if scaler:
                    scaler.unscale_(opt)
                if sharded:
                    norm = model.clip_grad_norm_(extra["clip"])
                else:
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), extra["clip"])
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if sharded and split > 1:
                groups = [list(range(i, i + split)) for i in range(0, world, split)]
                total = xm.all_reduce(xm.REDUCE_SUM, total, scale=1.0 / split, groups=groups)
            torch_xla.sync()
            losses.append(total.item())
            if "clip" in extra:
                norms.append(norm.item())
            if step == 2:
                graphs_at_step_2 = torch_xla._XLAC._xla_get_num_cached_compilation_graph()
        new_graphs = torch_xla._XLAC._xla_get_num_cached_compilation_graph() - graphs_at_step_2
        if sharded:
            params = full_parameters(model)
            buffers = {clean_name(k): v.cpu() for k, v in model.named_buffers()}
        else:
            params = {k: v.detach().float().cpu() for k, v in model.named_parameters()}
            if tied:
                params["head.weight"] = params["emb.weight"]
            buffers = {k: v.cpu() for k, v in model.named_buffers()}
        torch_xla.sync()
        results[name] = {"losses": losses, "norms": norms, "params": params, "buffers": buffers,
                         "new_graphs": new_graphs}
        if sharded and "hardware" in extra:
            from xla_fsdp._xla.private_api import collective_token_added
            results[name]["token_added"] = collective_token_added()
    return results


def paired(got, want, what="losses"):
    """(step, got, want) for every step, once both sides are known to have run the same
    number of steps, and some: ``zip`` alone would compare the shorter run's steps and pass,
    and a loop over no steps would check nothing."""
    assert len(got) == len(want), f"{len(got)} {what} against the reference's {len(want)}"
    return enumerate(pairs(got, want, what=what))


def compare(name, got, ref):
    """Problems of setting ``name``'s sharded run ``got`` against the reference ``ref``,
    within the suite's bounds ([Note: parity bounds] in ``bounds.py``)."""
    _, kwargs, opt, extra = SETTINGS[name]
    key = precision(kwargs.get("compute_dtype") or extra.get("autocast"))
    problems = loss_problems(got["losses"], ref["losses"], key)
    problems += loss_problems(got["norms"], ref["norms"], key, "total grad norm")
    problems += parameter_problems(got["params"], ref["params"], key,
                                   2 * ADAM_LR * STEPS if opt == "adamw" else None)
    for buffer, r in ref["buffers"].items():
        if got["buffers"][buffer].dtype != r.dtype:
            problems.append(f"buffer {buffer} is {got['buffers'][buffer].dtype}, not {r.dtype}")
        # running statistics of low-precision activations carry the activations' rounding
        elif (got["buffers"][buffer].float() - r.float()).abs().max() > PARAM[key]:
            problems.append(f"buffer {buffer} differs")
    if got["new_graphs"]:
        problems.append(f"{got['new_graphs']} graphs compiled after step 2")
    if got.get("token_added"):   # a TPU's collectives carry no token
        problems.append("its collectives carried torch_xla's token")
    return [f"{name}: {p}" for p in problems]
