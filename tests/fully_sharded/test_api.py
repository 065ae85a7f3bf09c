"""The wrapper's API beyond training parity, all checked in one launch at N = 2: options
reach auto-wrapped children, names of nested shards, meta-device init, divide factors,
gradients that are not views."""
import functools

import torch
import torch.nn as nn

from xla_fsdp import launch

from ..support.hlo import opcodes, traced_hlo
from ..support.models import DIM, Block, MemStack, Net
from ..support.parity import full_parameters
from ..support.checks import every, nonempty

WORLD = 2


def _children_options(out):
    from xla_fsdp import FSDP
    from xla_fsdp.wrap import transformer_auto_wrap_policy
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(Net(), auto_wrap_policy=policy, flatten_parameters=True,
                 reshard_after_forward=False, reduce_scatter_bucket_size_mb=3,
                 coalesce_all_gather_ops=True, compute_dtype=torch.bfloat16,
                 fp32_reduce_scatter=True, pin_layout_in_collective_ops=False,
                 optimization_barrier_in_backward=False, _shard_size_multiple=4)
    units = list(model.units())
    out["auto_wrapped_units"] = len(units)
    out["children_options_differ"] = [
        type(u.wrapped_module).__name__ for u in units if u.options != model.options]
    # a module's _wrap_overrides win over the policy's options, for that module only
    net = Net()
    net.b1._wrap_overrides = {"compute_dtype": torch.float32, "flatten_parameters": False}
    model = FSDP(net, auto_wrap_policy=policy, flatten_parameters=True,
                 compute_dtype=torch.bfloat16)
    out["wrap_overrides"] = {path: (u.compute_dtype, u.flatten_parameters)
                             for path, u in model.named_units()}


def _nested_names(out):
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    plain = Net()
    model = Net()
    model.load_state_dict(plain.state_dict())
    model.b1 = FSDP(model.b1)
    model.b2.up = FSDP(model.b2.up)
    model = FSDP(model)
    named = model.get_original_names_and_sharded_parameters()
    out["nested_names"] = sorted(n for n, _ in named)
    out["plain_names"] = sorted(n for n, _ in plain.named_parameters())
    # each shard is this rank's block of the original parameter
    out["nested_shards_match"] = every(
        torch.equal(shard.cpu(), dict(plain.named_parameters())[name].detach().reshape(-1)
                    [model.rank * shard.numel():][:shard.numel()].reshape(shard.shape).cpu())
        for name, shard in named if dict(plain.named_parameters())[name].numel() % WORLD == 0)


def _meta_init(out):
    from xla_fsdp import FSDP

    def fill(module):
        module.to_empty(device="cpu", recurse=True)
        with torch.no_grad():
            for i, p in enumerate(module.parameters()):
                p.fill_(float(i + 1))

    with torch.device("meta"):
        model = Net()
    model.b1 = FSDP(model.b1, param_init_fn=fill)
    model = FSDP(model, param_init_fn=fill)
    out["meta_param_init_fn"] = {k: v.unique().tolist() for k, v in full_parameters(model).items()}
    with torch.device("meta"):
        default = nn.Linear(8, 6)
    default = FSDP(default)  # no param_init_fn: materialised with reset_parameters()
    full = full_parameters(default)
    bound = 1 / 8 ** 0.5
    out["meta_default"] = (bool(full["weight"].abs().max() <= bound),
                           float(full["weight"].std()))


def _divide_factors(out, device):
    from xla_fsdp import FSDP
    grads, views = {}, []
    # torch_xla's rule: a factor divides only when above 1, and (1, 1) is the mean
    for label, factors in (("default", None), ("pre_all", (float(WORLD), 1.0)),
                           ("mean", (1.0, 1.0)), ("below_one", (0.5, 4.0)),
                           ("bucketed", None)):
        torch.manual_seed(0)
        model = FSDP(Net(), reduce_scatter_bucket_size_mb=1 if label == "bucketed" else 0)
        if factors:
            model.set_gradient_divide_factors(*factors, recursive=True)
            out[f"factors_{label}"] = (model.gradient_predivide_factor,
                                       model.gradient_postdivide_factor)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(5 + model.rank))
        model(x.to(device)).square().mean().backward()
        # a gradient that is a view keeps its base alive, and the step graph then outputs
        # both: twice the gradients' memory
        views += [f"{label}:{n}" for n, p in model.named_parameters() if p.grad._is_view()]
        grads[label] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()
    out["grad_views"] = views
    out["divide_pre_all"] = float((grads["pre_all"] - grads["default"]).abs().max())
    out["divide_mean"] = float((grads["mean"] - grads["default"]).abs().max())
    out["divide_below_one"] = float((grads["below_one"] - WORLD / 4 * grads["default"]).abs().max())
    out["grad_scale"] = float(grads["default"].abs().max())
    # a ScannedLayers stack's reductions follow the same rule
    from xla_fsdp import ScannedLayers
    scanned = {}
    for label, factors in (("default", None), ("mean", (1.0, 1.0)), ("below_one", (0.5, 4.0))):
        torch.manual_seed(0)
        stack = MemStack(layers=2, dim=16, hidden=32)
        stack.layers = ScannedLayers(stack.layers)
        model = FSDP(stack)
        if factors:
            model.set_gradient_divide_factors(*factors, recursive=True)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5 + model.rank))
        model(x.to(device)).square().mean().backward()
        scanned[label] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()
    out["scanned_grad_scale"] = float(scanned["default"].abs().max())
    out["scanned_divide_mean"] = float((scanned["mean"] - scanned["default"]).abs().max())
    out["scanned_divide_below_one"] = float(
        (scanned["below_one"] - WORLD / 4 * scanned["default"]).abs().max())


class _ScaledEmbedding(nn.Embedding):
    def forward(self, tokens):
        return super().forward(tokens) * 3.0


class _PaddedLM(nn.Module):
    def __init__(self, tied):
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=2)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=not tied)   # an untied head with a bias
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


def _vocab_tables(out, device):
    """vocab_parallel: the tables are row blocks that are never gathered (the placeholders
    stay empty while their modules run), and one step's outputs and gradients, padding row
    and divide factors included, are the unsharded model's on the global batch."""
    import copy

    from xla_fsdp import FSDP
    tokens = torch.tensor([[2, 0, 10, 2], [5, 9, 2, 1], [3, 3, 8, 7], [2, 6, 4, 10]])
    for tied in (True, False):
        torch.manual_seed(0)
        plain = _PaddedLM(tied)
        model = FSDP(copy.deepcopy(plain), vocab_parallel=True)
        model.set_gradient_divide_factors(0.5, 4.0, recursive=True)  # a sum over 4 ranks' data
        seen = []
        for m in (model.emb, model.head):
            m.register_forward_pre_hook(lambda mod, _a: seen.append(mod.weight.numel()))
        mine = tokens[2 * model.rank:2 * model.rank + 2]
        logits = model(mine.to(device))
        logits.square().sum().backward()
        plain = plain.to(device)
        if tied:
            plain.head.weight = plain.emb.weight  # moving to XLA unties
        want = plain(tokens.to(device))
        want.square().sum().div(4.0).backward()
        got = model.full_state_dict(rank0_only=False)
        tables = [g for g in model.shard_groups if g.vocab_table]
        # this rank's rows of 11 (6 and 5), of every table and of the head's bias
        first, n = 6 * model.rank, 5 if model.rank else 6
        checked = tables + [g for g in model.shard_groups if g.names == ["head.bias"]]
        grads = [float((g.shard.grad[:n] - plain.get_parameter(g.names[0]).grad[
            first:first + n]).abs().max()) for g in checked]
        out[f"vocab_{tied}"] = (
            seen, [tuple(g.shard.shape) for g in tables],
            float((logits - want[2 * model.rank:2 * model.rank + 2]).abs().max()),
            [g.names[0] for g in checked], max(grads),
            float(plain.emb.weight.grad.abs().max()),
            sorted(got) == sorted(plain.state_dict()))
    # a subclass's own forward is kept: its weight stays an ordinary parameter
    torch.manual_seed(0)
    plain = _PaddedLM(True)
    plain.emb = _ScaledEmbedding(11, 6, padding_idx=2)
    plain.head.weight = plain.emb.weight
    model = FSDP(copy.deepcopy(plain), vocab_parallel=True)
    out["vocab_subclass"] = (
        [g.names for g in model.shard_groups if g.vocab_table],
        float((model(tokens.to(device)) - plain.to(device)(tokens.to(device))).abs().max()))
    for label, build in (("offload", lambda: FSDP(_PaddedLM(True), vocab_parallel=True,
                                                  offload_optimizer=True)),
                         ("max_norm", lambda: FSDP(nn.Embedding(5, 3, max_norm=1.0),
                                                   vocab_parallel=True))):
        try:
            build()
            out[f"vocab_refused_{label}"] = "no error"
        except ValueError as exc:
            out[f"vocab_refused_{label}"] = str(exc)


class _Initializer:
    def fill(self, module):
        for p in module.parameters(recurse=False):
            torch.nn.init.constant_(p, 0.5)


def _torch_xla_arguments(out, device):
    """torch_xla's constructor switches and attributes beyond the parity settings."""
    import torch_xla
    from xla_fsdp import FSDP
    from xla_fsdp._sharding.layout import Dim0Layout
    from xla_fsdp._unit.options import FsdpOptions
    from xla_fsdp._unit.training_state import TrainingState
    out["on_neuron_dim0"] = every(isinstance(g.layout, Dim0Layout)
                                  for g in FSDP(Net(), on_neuron=True).shard_groups)
    # the aliases set their options, and the arguments an auto-wrapped child gets rebuild them
    aliased = FSDP(Net(), mark_step_on_finalization=True, on_neuron=True,
                   reduce_scatter_bucket_size_mb=None,
                   _debug_dummy_optimization_barrier_op=True).options
    out["aliases"] = (aliased.sync_on_finalization, aliased.shard_param_on_dim_0,
                      aliased.reduce_scatter_bucket_size_mb,
                      aliased.optimization_barrier_in_forward,
                      aliased.optimization_barrier_in_backward,
                      FsdpOptions.from_arguments(aliased.as_arguments()) == aliased)
    # torch_xla's attributes for the arguments, read-only
    unit = FSDP(Net(), disable_reshard_on_root=False, fp32_reduce_scatter=True,
                optimization_barrier_in_forward=False, mark_step_on_finalization=True,
                _shard_size_multiple=4)
    out["option_attributes"] = (unit.disable_reshard_on_root, unit.fp32_reduce_scatter,
                                unit.optimization_barrier_in_forward,
                                unit.optimization_barrier_in_backward,
                                unit.sync_on_finalization, unit._shard_size_multiple)
    try:
        unit.compute_dtype = torch.bfloat16
        out["option_set_later"] = "no error"
    except AttributeError as exc:
        out["option_set_later"] = str(exc)
    # a forward under inference_mode, which torch_xla cannot run unwrapped, gives no_grad's
    # values (see [Note: a forward under inference_mode])
    nested = FSDP(nn.Sequential(FSDP(nn.Linear(32, 8)), nn.Linear(8, 2)))
    x = torch.randn(4, 32).to(device)
    with torch.no_grad():
        want = nested(x).cpu()
    with torch.inference_mode():
        got = nested(x).cpu()
    out["inference_mode"] = float((got - want).abs().max())
    # BatchNorm's statistics stay float32 under buffer_dtype, float32 compute too
    bn = FSDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)),
              buffer_dtype=torch.bfloat16)
    bn(torch.randn(4, 8).to(device)).sum().backward()
    torch_xla.sync()
    out["batch_norm_statistics"] = str(bn.module[1].running_mean.dtype)
    # loss scaling under fp16: an overflow in one rank's slice only (the bias, rank 0's)
    # skips the step on every rank (see [Note: loss scaling over shards])
    torch.manual_seed(0)
    scaled = FSDP(torch.nn.Linear(8, 2), compute_dtype=torch.float16)
    opt = torch.optim.SGD(scaled.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("xla", init_scale=2.0 ** 16)
    x = torch.full((4, 8), 1e-3).to(device)
    out["loss_scaling"] = []
    for _ in range(2):
        before = [p.detach().cpu().clone() for p in scaled.parameters()]
        opt.zero_grad()
        y = scaled(x).float()
        scaler.scale((y[:, 0] * 0.305 + y[:, 1] * 0.01).sum()).backward()
        scaler.step(opt)
        scaler.update()
        torch_xla.sync()
        moved = any(not torch.equal(a, p.detach().cpu()) for a, p in
                    zip(before, scaled.parameters(), strict=True))
        out["loss_scaling"].append((scaler.get_scale(), moved))
    # auto-wrapped children get the same param_init_fn, not a copy of what it is bound to
    initializer = _Initializer()
    given = FSDP(Net(), param_init_fn=initializer.fill).options.as_arguments()["param_init_fn"]
    out["param_init_fn_bound_to_the_same"] = given.__self__ is initializer
    model = FSDP(Net(), _debug_dummy_all_gather_op=True, _debug_dummy_reduce_scatter_op=True,
                 _debug_dummy_all_reduce_op=True, _debug_dummy_optimization_barrier_op=True)
    model(torch.randn(4, 32).to(device)).sum().backward()
    norm = model.clip_grad_norm_(1.0)
    ops = opcodes(traced_hlo([p.grad for p in model.params_with_grad] + [norm]))
    out["dummy_step_collectives"] = [op for op in ("all-gather", "reduce-scatter", "all-reduce",
                                                   "opt-barrier") if op in ops]
    out["params_with_grad"] = [id(p) for p in model.params_with_grad] == \
        [id(p) for p in model.parameters()]  # every one, itself, in order
    try:
        model.assert_state(TrainingState.FORWARD)
    except ValueError as exc:  # torch_xla raises ValueError
        out["assert_state"] = type(exc).__name__
    # what torch_xla's frozen-weight test reads: full params held during forward, freed
    # after backward, a frozen weight's too
    linear = nn.Linear(16, 16)
    linear.weight.requires_grad = False
    linear = FSDP(linear)
    seen = []
    linear.register_forward_hook(
        lambda *_: seen.append([p._has_full_param for p in linear.full_params]))
    linear(torch.rand(2, 16).to(device)).sum().backward()
    out["has_full_param"] = (seen, [p._has_full_param for p in linear.full_params])
    kept = FSDP(nn.Linear(16, 16), reshard_after_forward=False)
    kept(torch.rand(2, 16).to(device))
    out["has_full_param_kept"] = [p._has_full_param for p in kept.full_params]
    torch_xla.sync()


def _attribute_fall_through(out):
    """What a unit, unit.module and a scanned stack answer for: the wrapped module's
    attributes; for a stack, the ModuleList's, then its first layer's."""
    from xla_fsdp import FSDP, ScannedLayers
    net = Net()
    net.setting = "s"
    unit = FSDP(net)
    stack = nn.ModuleList([Block(), Block()])
    for layer in stack:
        layer.attention_type = "full"
    stack = ScannedLayers(stack)
    missing = []
    for owner in (unit, unit.module, stack):
        try:
            owner.absent
        except AttributeError as exc:
            missing.append(str(exc))
    out["fall_through"] = (unit.setting, unit.module.setting, unit.module.module is net,
                           unit.head is net.head, stack.attention_type,
                           stack.append.__self__ is stack.wrapped_module, missing)
    # writes reach what reads see ([Note: a setting written through a unit]); a name the
    # module lacks, or a private one, stays on the unit
    unit.setting = "t"
    written = [net.setting]
    unit.module.setting = "u"
    unit.extra, unit._private = 1, 2
    out["written_through"] = written + [net.setting, "setting" in vars(unit),
                                        hasattr(net, "extra"), hasattr(net, "_private")]
    # an optimizer built from unit.module trains every shard, the unit's own included
    out["view_parameters"] = [id(p) for p in unit.module.parameters()] == \
        [id(p) for p in unit.parameters()] != []
    _unit_kinds(out, stack)


def _view_registrations(out, device):
    """What is registered through ``unit.module`` is registered on the module the unit's
    forward calls; a unit is neither deep-copied nor pickled ([Note: a unit is not
    copied])."""
    import copy
    import pickle
    from xla_fsdp import FSDP
    net = Net()
    unit = FSDP(net)
    calls = []
    unit.module.register_forward_hook(lambda module, args, output: calls.append(module is net))
    unit.module.register_buffer("marker", torch.ones(2))
    unit(torch.ones(2, DIM, device=device))
    out["view_registrations"] = (calls, "marker" in unit.full_state_dict(rank0_only=False))
    refused = []   # a second unit around net would hold none of the first one's shards
    for attempt in (lambda: copy.deepcopy(unit), lambda: pickle.dumps(unit), lambda: FSDP(net)):
        try:
            attempt()
            refused.append("done")
        except (TypeError, ValueError) as exc:
            refused.append(str(exc))
    out["unit_not_copied"] = refused


def _unit_kinds(out, stack):
    """A scanned stack is a unit of its own kind: the unit surface, not the wrapper's hooks
    around its modules, which its loop would have to switch off."""
    from xla_fsdp import FSDP, UnitModule
    root = FSDP(nn.Sequential(stack))
    out["unit_kinds"] = (isinstance(stack, UnitModule), isinstance(stack, FSDP),
                         len(stack.wrapped_module._forward_pre_hooks),
                         len(stack.wrapped_module._forward_hooks),
                         [type(u).__name__ for u in root.units()],
                         hasattr(stack, "unshard"), stack.world_size == root.world_size)
    # the schedule's controls are the wrapper's: a stack gathers one layer at a time in its
    # scan, so it has none, recursion from the root passes it by, and it cannot be prefetched
    out["stack_controls"] = [name for name in (
        "set_reshard_after_forward", "set_reshard_after_backward", "reshard",
        "set_modules_to_forward_prefetch", "reshard_after_forward") if hasattr(stack, name)]
    root.set_reshard_after_forward(False)
    root.set_reshard_after_backward(False)
    out["root_schedule"] = (root.reshard_after_forward, root.reshard_after_backward)
    try:
        root.set_modules_to_forward_prefetch([stack])
        out["prefetch_stack"] = "no error"
    except TypeError as exc:
        out["prefetch_stack"] = str(exc)


class _OwnLoss(nn.Module):
    """A model that returns its loss, as Hugging Face's do given labels: a reduction whose
    gradient does not read it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).exp().sum()


def _loss_before_backward(out, device):
    """The backward's first barrier holds the loss: every gradient's graph computes it
    (see [Note: the loss before the backward]); the loss equals the unwrapped model's."""
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    plain = _OwnLoss()
    model = FSDP(_OwnLoss())
    model.load_state_dict(plain.state_dict())
    x = torch.randn(4, 32)
    loss = model(x.to(device))
    loss.backward()
    hlo = traced_hlo([p.grad for p in model.parameters()])
    out["loss_in_gradients"] = "reduce" in opcodes(hlo)
    out["loss_value"] = abs(float(loss.cpu()) - float(plain(x)))


def _apply_init(out):
    """``model.apply(fn)`` after wrapping changes the shards as ``fn`` changes the unwrapped
    model, written in place or through ``.data`` (transformers' ``_init_weights``), with
    float32 masters exact under bf16 compute, flat and dim-0 shards alike."""
    from xla_fsdp import FSDP

    def init(m):
        if isinstance(m, nn.Linear):
            m.weight.data.mul_(0.5)
            nn.init.constant_(m.bias, 0.05)
    torch.manual_seed(0)
    plain = Net()
    model = Net()
    model.load_state_dict(plain.state_dict())
    model.b1 = FSDP(model.b1, compute_dtype=torch.bfloat16, flatten_parameters=True)
    model = FSDP(model, compute_dtype=torch.bfloat16, shard_param_on_dim_0=True)
    model.apply(init)
    plain.apply(init)
    full = model.full_state_dict(rank0_only=False)
    out["apply_init"] = sorted(k for k, v in plain.state_dict().items()
                               if not torch.equal(full[k].cpu(), v))
    out["apply_init_changed"] = float(full["head.bias"][0])

    # vocabulary tables, never gathered for a forward, are gathered for apply (a padding
    # row written by its index, as transformers' _init_weights does)
    def init_tables(m):
        if isinstance(m, nn.Embedding):
            m.weight.data.mul_(0.5)
            m.weight.data[m.padding_idx].fill_(0.25)
        elif isinstance(m, nn.Linear):
            m.weight.data.add_(1.0)
    for tied in (True, False):
        torch.manual_seed(0)
        plain = _PaddedLM(tied)
        model = FSDP(_PaddedLM(tied), vocab_parallel=True)
        model.load_full_state_dict(plain.state_dict())
        model.apply(init_tables)
        plain.apply(init_tables)
        full = model.full_state_dict(rank0_only=False)
        out[f"apply_vocab_{tied}"] = sorted(k for k, v in plain.state_dict().items()
                                            if not torch.equal(full[k].cpu(), v))


def _offload_rank_scalars(out, device, rank):
    """With ``offload_optimizer`` the inf flag and a clip's local norm are host scalars that
    differ between ranks; a 0-d 0 or 1 moved to the device would be baked into each rank's
    program (an inf on one rank's shard only; a rank whose every gradient is 0)."""
    import copy

    from xla_fsdp import FSDP
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), offload_optimizer=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("xla", init_scale=2.0 ** 8)
    scaler.scale(model(torch.ones(4, 8).to(device)).sum()).backward()
    next(iter(model.parameters())).grad[0] += float("inf") if rank == 0 else 0.0
    scaler.step(opt)
    scaler.update()
    out["offload_inf_on_one_rank"] = float(scaler.get_scale())
    model = FSDP(nn.Embedding(8, 4), offload_optimizer=True, shard_param_on_dim_0=True)
    model(torch.tensor([[0, 1, 2, 3]]).to(device)).sum().backward()   # rank 0's rows only
    out["offload_norm_zero_on_one_rank"] = float(model.clip_grad_norm_(1.0))
    # writes through .data reach the device copy: assigned (vector_to_parameters), in place
    torch.manual_seed(0)
    plain = nn.Linear(4, 3)
    model = FSDP(copy.deepcopy(plain), offload_optimizer=True)
    x = torch.ones(2, 4)
    model(x.to(device))
    halved = [p.detach() * 0.5 for p in model.parameters()]
    torch.nn.utils.vector_to_parameters(torch.cat(halved), list(model.parameters()))
    with torch.no_grad():
        plain.weight.mul_(0.5), plain.bias.mul_(0.5)
    out["offload_data_assigned"] = float((model(x.to(device)).cpu() - plain(x)).abs().max())
    for p in [*model.parameters(), *plain.parameters()]:
        p.data.add_(1.0)
    out["offload_data_in_place"] = float((model(x.to(device)).cpu() - plain(x)).abs().max())


def checks(rank):
    import torch_xla
    device = torch_xla.device()
    out = {}
    _children_options(out)
    _nested_names(out)
    _meta_init(out)
    _divide_factors(out, device)
    _vocab_tables(out, device)
    _torch_xla_arguments(out, device)
    _attribute_fall_through(out)
    _view_registrations(out, device)
    _loss_before_backward(out, device)
    _apply_init(out)
    _offload_rank_scalars(out, device, rank)
    torch_xla.sync()
    return out


def test_wrapper_api():
    results = launch(checks, num_devices=WORLD)
    out = results[0]
    # both ranks skip the first step and lower their scale; both take the second
    for rank_out in nonempty(results.values(), "ranks"):
        assert rank_out["loss_scaling"] == [(2.0 ** 15, False), (2.0 ** 15, True)], \
            rank_out["loss_scaling"]
    # Net has two Blocks, so the policy makes them units under the root
    assert out["auto_wrapped_units"] == 3
    assert out["children_options_differ"] == []
    assert out["wrap_overrides"] == {"": (torch.bfloat16, True),
                                     "_fsdp_wrapped_module.b1": (torch.float32, False),
                                     "_fsdp_wrapped_module.b2": (torch.bfloat16, True)}, \
        out["wrap_overrides"]
    assert out["nested_names"] == out["plain_names"]
    assert out["apply_init"] == [] and out["apply_init_changed"] == torch.tensor(0.05).item(), \
        (out["apply_init"], out["apply_init_changed"])
    assert out["nested_shards_match"]
    # fill() numbers the parameters it is given 1, 2, ...: the inner unit's own, then the
    # root's without the inner unit's (which were sharded already and must stay untouched)
    inner = ["norm.weight", "norm.bias", "up.weight", "up.bias", "down.weight", "down.bias"]
    root = ["inp.weight", "inp.bias"] + ["b2." + n for n in inner] + ["head.weight", "head.bias"]
    expected = {**{"b1." + n: [float(i + 1)] for i, n in enumerate(inner)},
                **{n: [float(i + 1)] for i, n in enumerate(root)}}
    assert out["meta_param_init_fn"] == expected
    within_bound, std = out["meta_default"]
    assert within_bound and std > 0.05
    assert out["grad_views"] == []
    assert out["grad_scale"] > 1e-4
    assert out["divide_pre_all"] <= 1e-6 * out["grad_scale"]
    assert out["divide_mean"] <= 1e-6 * out["grad_scale"]
    assert out["divide_below_one"] <= 1e-6 * out["grad_scale"]
    assert out["scanned_grad_scale"] > 1e-4
    assert out["scanned_divide_mean"] <= 1e-6 * out["scanned_grad_scale"]
    assert out["scanned_divide_below_one"] <= 1e-6 * out["scanned_grad_scale"]
    for tied in (True, False):
        seen, shapes, logits, checked, grad, scale, names = out[f"vocab_{tied}"]
        assert seen == [0, 0] and shapes == [(6, 6)] * (1 if tied else 2), (seen, shapes)
        assert checked == (["emb.weight"] if tied else
                           ["emb.weight", "head.weight", "head.bias"]), checked
        assert logits <= 1e-5 and grad <= 1e-5 * scale and scale > 1e-3 and names, \
            out[f"vocab_{tied}"]
    tables, logits = out["vocab_subclass"]
    assert tables == [] and logits <= 1e-5, out["vocab_subclass"]
    assert out["apply_vocab_True"] == [] and out["apply_vocab_False"] == [], \
        (out["apply_vocab_True"], out["apply_vocab_False"])
    for rank_out in nonempty(results.values(), "ranks"):
        assert rank_out["offload_inf_on_one_rank"] == 2.0 ** 7   # every rank skipped
        assert rank_out["offload_norm_zero_on_one_rank"] == 4.0  # 4 rows' sums of ones
        assert rank_out["offload_data_assigned"] <= 1e-6, rank_out["offload_data_assigned"]
        assert rank_out["offload_data_in_place"] <= 1e-6, rank_out["offload_data_in_place"]
    assert "offload_optimizer" in out["vocab_refused_offload"]
    assert "embedding 'weight' uses max_norm" in out["vocab_refused_max_norm"], \
        out["vocab_refused_max_norm"]
    assert out["factors_mean"] == (1.0, 1.0) and out["factors_below_one"] == (0.5, 4.0)
    assert out["on_neuron_dim0"]
    assert out["option_attributes"] == (False, True, False, True, True, 4)
    assert out["batch_norm_statistics"] == "torch.float32"
    assert out["inference_mode"] == 0.0
    assert "compute_dtype is set when the unit is built" in out["option_set_later"], \
        out["option_set_later"]
    assert out["aliases"] == (True, True, 0, False, False, True)
    assert out["param_init_fn_bound_to_the_same"]
    assert out["dummy_step_collectives"] == []
    assert out["params_with_grad"]
    assert out["assert_state"] == "TrainingStateError"
    assert out["has_full_param"] == ([[True, True]], [False, False])
    assert out["has_full_param_kept"] == [True, True]
    assert out["view_registrations"] == ([True], True), out["view_registrations"]
    copied, pickled, again = out["unit_not_copied"]
    assert "FSDP unit around Net cannot be deep-copied. Copy the model before wrapping" \
        in copied and "cannot be pickled (torch.save(model), pickle)" in pickled and \
        "this Net is already wrapped: an FSDP unit was built around it" in again, \
        out["unit_not_copied"]
    assert out["unit_kinds"] == (True, False, 0, 0,
                                 ["XlaFullyShardedDataParallel", "ScannedLayers"], False, True)
    assert out["stack_controls"] == [] and out["root_schedule"] == (False, False)
    assert out["prefetch_stack"].startswith("set_modules_to_forward_prefetch: ScannedLayers "
                                            "gathers one layer at a time"), out["prefetch_stack"]
    assert out["loss_in_gradients"] and out["loss_value"] < 1e-4, \
        (out["loss_in_gradients"], out["loss_value"])
    assert out["written_through"] == ["t", "u", False, False, False], out["written_through"]
    assert out["view_parameters"]
    assert out["fall_through"] == ("s", "s", True, True, "full", True, [
        "'Net' object has no attribute 'absent'", "'Net' object has no attribute 'absent'",
        "'Block' object has no attribute 'absent'"])
