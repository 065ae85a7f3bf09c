"""Forward/backward patterns of real training code, each trained wrapped in FSDP and compared
with the same model trained unsharded (run by ``tests/fully_sharded/test_patterns.py``).

Every scenario runs in one launch at N = 2, and every rank trains the unsharded reference
itself, on its own device with the global batch: a second launch for the reference would
cost as much as the whole workload again. The reference holds no collective, so both ranks
compute the same values for it.

A scenario appends problem strings instead of asserting, and an exception ends only its own
scenario (or part), so that one broken pattern does not hide the others. This is safe only
because every rank runs exactly the same code: the wrapper's failures do not depend on the
rank, so every rank raises at the same point and reaches the same collectives afterwards.
For the same reason nothing here branches on a compared value, and nothing rank-dependent
enters a device graph: the batch is sliced on the CPU, and outputs are compared on the CPU.
"""
from __future__ import annotations

import copy
import gc
import os
from typing import Callable, Dict, List

import torch

from .checks import nonempty
from .models import GLOBAL_BATCH, Block, Net, batch, loss_fn
from .pattern_models import (BufferNet, BuriedNet, DataclassNet, PenalisedNet, ScaledNet,
                             SharedEmbeddingLM, SharedLayerNet, SkipNet)
from .patterns import (TOL, WORLD, Context, Pair, check_strict_round_trip,
                              compare_values, describe, placeholder, seeded, sgd, wrap_blocks,
                              wrap_grouped)


def _hook_count(t):
    return len(getattr(t, "_backward_hooks", None) or {})


def leaf_input_hooks(ctx):
    """A parent's parameter passed into a child unit as an input, six steps."""
    import torch_xla
    p = Pair(ctx, ScaledNet)
    counts, at_step_2 = [], None
    for step in range(6):
        p.step(f"step {step}")
        counts.append(_hook_count(placeholder(p.model, "scale")))
        if step == 2:
            at_step_2 = torch_xla._XLAC._xla_get_num_cached_compilation_graph()
    new_graphs = torch_xla._XLAC._xla_get_num_cached_compilation_graph() - at_step_2
    if any(b > a for a, b in zip(counts, counts[1:])):
        ctx.problem(f"hooks on the root's `scale` placeholder grow step by step: {counts}")
    if new_graphs:
        ctx.problem(f"{new_graphs} graph(s) compiled after step 2")
    p.compare_params("after 6 steps")


def submodule_backward(ctx):
    ctx.part("b1-only backward", _b1_only_backward)
    ctx.part("loss from a hooked activation", _hooked_activation_loss)


def _b1_only_backward(ctx):
    """``model.b1(x)`` alone, forward and backward, then an optimizer step."""
    p = Pair(ctx, Net)

    def b1_step(tag):
        xl, _, xg, _ = p.data()
        p.zero_grad()
        loss = p.model.b1(xl).pow(2).mean()
        loss.backward()
        ref = p.plain.b1(xg).pow(2).mean()
        ref.backward()
        p.opt_step()
        p.finish(tag, loss, ref)
        p.compare_params(tag)

    b1_step("b1-only step before the root's first forward")
    p.step("step 1")
    p.step("step 2")
    b1_step("b1-only step between steps")
    p.step("step 4")
    p.step("step 5")
    p.compare_params("after step 5")


def _hooked_activation_loss(ctx):
    """The loss is b1's output, captured by a forward hook; the root's output is unused."""
    p = Pair(ctx, Net)
    captured = {}
    p.model.b1.register_forward_hook(lambda m, i, o: captured.__setitem__("sharded", o))
    p.plain.b1.register_forward_hook(lambda m, i, o: captured.__setitem__("plain", o))
    for step in range(3):
        xl, _, xg, _ = p.data()
        p.zero_grad()
        p.model(xl)
        loss = captured["sharded"].pow(2).mean()
        loss.backward()
        p.plain(xg)
        ref = captured["plain"].pow(2).mean()
        ref.backward()
        p.opt_step()
        p.finish(f"step {step}", loss, ref)
    p.compare_params("after 3 steps")


def retain_graph(ctx):
    p = Pair(ctx, Net)
    p.step("step 0")
    xl, yl, xg, yg = p.data()
    p.zero_grad()
    loss = p.loss(p.model(xl), yl)
    loss.backward(retain_graph=True)
    loss.backward()
    ref = p.loss(p.plain(xg), yg)
    ref.backward(retain_graph=True)
    ref.backward()
    p.opt_step()
    p.finish("step 1 (two backwards)", loss, ref)
    p.compare_params("after the step over two backwards")
    p.step("step 2")
    p.step("step 3")
    p.compare_params("after step 3")


def nested_before_root(ctx):
    p = Pair(ctx, Net)

    def enter_no_sync():
        with p.model.b1.no_sync():
            pass

    for what, fn in (("b1.no_sync()", enter_no_sync),
                     ("b1.full_state_dict()", lambda: p.model.b1.full_state_dict())):
        try:
            fn()
        except RuntimeError as exc:
            if "root" not in str(exc):
                ctx.problem(f"{what} before the root's first forward raised without naming "
                            f"the root: {describe(exc)}")
        except Exception as exc:
            ctx.problem(f"{what} before the root's first forward raised {describe(exc)}, "
                        f"not a RuntimeError")
        else:
            ctx.problem(f"{what} on a nested unit before the root's first forward raised "
                        f"no error")
    b1_names = [n for n in p.names if n.startswith("b1.")]
    for step in range(3):
        p.step(f"step {step}", after_forward=lambda: p.check_freed(
            f"step {step}, right after the root's forward, b1", b1_names))
    p.compare_params("after 3 steps")


def dataclass_outputs(ctx):
    ctx.part("dataclass and object outputs", _dataclass_outputs)
    ctx.part("an output FSDP cannot find", _buried_output)


def _dataclass_outputs(ctx):
    p = Pair(ctx, DataclassNet)
    for step in range(3):
        p.step(f"step {step}")
    p.compare_params("after 3 steps")


def _buried_output(ctx):
    """No hook can reach it, so the unit keeps its parameters for backward (and warns)."""
    import warnings
    p = Pair(ctx, BuriedNet)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(2):
            p.step(f"step {step}")
    if not any("BuriedBlock" in str(w.message) for w in seen):
        ctx.problem("no warning names the unit whose output FSDP cannot see")
    p.compare_params("after 2 steps")


def freeze_after_wrap(ctx):
    def shards(model):
        for q in model.b1.parameters():
            q.requires_grad_(False)

    def plain_b1(plain):
        for q in plain.b1.parameters():
            q.requires_grad_(False)

    ctx.part("b1 frozen through its shards", lambda c: _frozen(c, shards, plain_b1))
    ctx.part("b2.up.weight frozen through its placeholder", lambda c: _frozen(
        c, lambda m: m.b2.wrapped_module.up.weight.requires_grad_(False),
        lambda plain: plain.b2.up.weight.requires_grad_(False)))
    # a module inside a unit holds placeholders, not parameters: its requires_grad_ reaches
    # them too
    ctx.part("b1.up frozen through the module's requires_grad_", lambda c: _frozen(
        c, lambda m: m.b1.up.requires_grad_(False),
        lambda plain: plain.b1.up.requires_grad_(False)))
    ctx.part("b1 frozen between a forward and its backward", lambda c: _frozen_after_forward(
        c, lambda m: m.b1.requires_grad_(False), lambda plain: plain.b1.requires_grad_(False)))
    ctx.part("b1.up frozen between a forward and its backward", lambda c: _frozen_after_forward(
        c, lambda m: m.b1.up.requires_grad_(False),
        lambda plain: plain.b1.up.requires_grad_(False)))

    # everything frozen, then the head unfrozen through its shards: the newer flag wins
    def all_but_head(m):
        m.requires_grad_(False)
        for name, shard in nonempty(m.get_original_names_and_sharded_parameters(), "shards"):
            if name.startswith("head."):
                shard.requires_grad_(True)

    def plain_all_but_head(plain):
        plain.requires_grad_(False)
        plain.head.requires_grad_(True)
    ctx.part("all frozen, then the head unfrozen", lambda c: _frozen(
        c, all_but_head, plain_all_but_head))


def _frozen(ctx, freeze_wrapped, freeze_plain):
    p = Pair(ctx, Net, optimizers=False)
    freeze_wrapped(p.model)
    freeze_plain(p.plain)
    p.make_optimizers()
    for step in range(3):
        p.step(f"step {step}", after_step=lambda: p.check_no_placeholder_grads(
            f"after step {step}"))
    p.compare_params("after 3 steps")


def _frozen_after_forward(ctx, freeze_wrapped, freeze_plain):
    """torch gives a leaf that no longer requires grad when backward reaches it no gradient;
    the reference is frozen before its forward, which gives the same."""
    p = Pair(ctx, Net)
    p.step("step 0")

    def freeze():
        freeze_wrapped(p.model)
        freeze_plain(p.plain)
    p.step("step 1, frozen after the forward", after_forward=freeze)
    p.step("step 2")
    p.compare_params("after 3 steps")


def own_parameters_in_forward(ctx):
    """Each block's forward lists its own parameters (a penalty, the dtype of its input):
    the full values its unit holds then ([Note: a module's parameters inside its unit])."""
    p = Pair(ctx, PenalisedNet, wrap=wrap_blocks)
    for step in range(3):
        p.step(f"step {step}")
    p.compare_params("after 3 steps")


def frozen_for_a_reference_forward(ctx):
    """peft's ``disable_adapter()`` around a reference forward inside a ``no_sync``
    accumulation (TRL's DPO without a separate reference model): a module inside a unit is
    frozen through its ``parameters()`` for a no-grad forward and unfrozen; the gradient it
    accumulated before is kept, as torch keeps a frozen parameter's, and reduced with the
    last micro-batch's."""
    p = Pair(ctx, Net, wrap=wrap_blocks)
    p.zero_grad()
    for micro in range(2):
        xl, yl, xg, yg = p.data()
        for q in p.model.b1.up.parameters():   # the placeholders of a module in b1's unit
            q.requires_grad = False
        with torch.no_grad():
            p.model(xl)
        for q in p.model.b1.up.parameters():
            q.requires_grad = True
        if micro == 0:
            with p.model.no_sync():
                p.loss(p.model(xl), yl).backward()
        else:
            loss = p.loss(p.model(xl), yl)
            loss.backward()
        ref = p.loss(p.plain(xg), yg)
        ref.backward()
    p.opt_step()
    p.finish("two micro-batches, a reference forward before each", loss, ref)
    p.compare_params("after the accumulated step")


def non_persistent_buffer(ctx):
    # one no-grad forward instead of training: what is at stake is the names, and each step
    # graph costs compile time
    import torch_xla
    p = Pair(ctx, BufferNet)
    n, r = GLOBAL_BATCH // WORLD, ctx.rank
    xl, _, xg, _ = p.data()
    with torch.no_grad():
        out, ref = p.model(xl), p.plain(xg)
    torch_xla.sync()
    diff = float((out.cpu() - ref.cpu()[r * n:(r + 1) * n]).abs().max())
    if not diff <= TOL:
        ctx.problem(f"forward output: max diff {diff:.3g} from the reference")
    full = p.model.full_state_dict(rank0_only=False)
    compare_values(ctx, "before training", full, {
        k: v.detach().cpu() for k, v in p.plain.state_dict().items()})
    check_strict_round_trip(ctx, p, full, BufferNet)


def group_member_skipped(ctx):
    ctx.part("extra on even steps only", lambda c: _grouped(c, [1, 0, 1, 0]))
    ctx.part("extra twice per forward", lambda c: _grouped(c, [2, 2, 2]))


def _grouped(ctx, calls_per_step):
    p = Pair(ctx, SkipNet, wrap=wrap_grouped)
    grouped = [n for n in p.names if n.startswith(("inp.", "extra."))]
    for step, calls in enumerate(calls_per_step):
        tag = f"step {step} (extra called {calls}x)"
        p.step(tag, call=lambda m, x: m(x, extra_calls=calls),
               after_forward=lambda: p.check_freed(f"{tag}, after the forward, grouped unit",
                                                   grouped),
               after_backward=lambda: p.check_freed(f"{tag}, after backward, grouped unit",
                                                    grouped))
    p.compare_params("after the last step")


def eval_no_grad(ctx):
    import torch_xla
    p = Pair(ctx, Net)
    n, r = GLOBAL_BATCH // WORLD, ctx.rank
    for step in range(2):
        p.step(f"step {step}")
        xl, _, xg, _ = p.data()
        with torch.no_grad():
            out = p.model(xl)
            p.check_freed(f"after the no-grad forward following step {step}")
            ref = p.plain(xg)
        torch_xla.sync()
        diff = float((out.cpu() - ref.cpu()[r * n:(r + 1) * n]).abs().max())
        if not diff <= TOL:
            ctx.problem(f"eval output after step {step}: max diff {diff:.3g} from the reference")
    p.compare_params("after 2 steps with evals")


def load_assign(ctx):
    ctx.part("load_state_dict(assign=True)", lambda c: _assign(c, keep_b1=False))
    ctx.part("load_state_dict(assign=True), b1 not resharded after backward",
             lambda c: _assign(c, keep_b1=True))


def _assign(ctx, keep_b1):
    p = Pair(ctx, Net)
    other_cpu = seeded(1, Net)
    other_plain_state = copy.deepcopy(other_cpu.state_dict())
    other = wrap_blocks(other_cpu)
    if keep_b1:
        p.model.b1.set_reshard_after_backward(False)
    p.step("step 0")
    p.step("step 1")
    p.model.load_state_dict(other.state_dict(), assign=True)
    # the reference copies into its parameters, so its optimizer keeps stepping them
    p.plain.load_state_dict(other_plain_state)
    p.compare_params("right after the load")
    p.step("step 2 (first after the load)")
    p.step("step 3")
    p.compare_params("after step 3")


def abandoned_no_sync(ctx):
    p = Pair(ctx, Net)
    p.step("step 0")
    xl, yl, xg, yg = p.data()
    p.zero_grad()
    with p.model.no_sync():
        p.loss(p.model(xl), yl).backward()
    p.loss(p.plain(xg), yg).backward()
    # a step now would apply gradients no rank has reduced yet
    _, stepped = ctx.attempt("optimizer step after a no_sync backward", p.opt.step)
    if stepped:
        ctx.problem("an optimizer step on unreduced no_sync gradients raised nothing")
    elif "no_sync" not in ctx.problems[-1]:
        ctx.problem("the refused step's error does not name no_sync")
    else:
        ctx.problems.pop()  # the expected refusal
    p.zero_grad()  # the accumulation is abandoned: no step
    p.step("synced step after the abandoned micro-batch",
           after_step=lambda: p.check_no_placeholder_grads("after the synced step"))
    p.compare_params("after the synced step")
    p.step("next step")
    p.compare_params("after the next step")
    # dropped again, by an optimizer that zeroes in place with foreach kernels (see
    # [Note: zeroing gradients with foreach kernels])
    xl, yl, _, _ = p.data()
    with p.model.no_sync():
        p.loss(p.model(xl), yl).backward()
    torch.optim.SGD(p.model.parameters(), lr=0.1, foreach=True).zero_grad(set_to_none=False)
    p.plain_opt.zero_grad()
    xl, yl, xg, yg = p.data()
    loss = p.loss(p.model(xl), yl)
    loss.backward()
    ref = p.loss(p.plain(xg), yg)
    ref.backward()
    p.opt_step()
    p.finish("synced step after a micro-batch dropped by foreach zeroing", loss, ref)
    p.compare_params("after the micro-batch dropped by foreach zeroing")


def optimizer_in_backward(ctx):
    """Each parameter's own optimizer steps in its post-accumulate-grad hook: on the shards
    once per synchronised backward, after their reduction, as the unsharded model's hooks
    step its parameters (see [Note: hooks on a shard's gradient])."""
    import torch_xla
    p = Pair(ctx, Net, optimizers=False)
    optimizers, runs = [], []

    def step_in_backward(params, counted):
        for q in params:
            opt = sgd([q])
            optimizers.append(opt)

            def hook(param, opt=opt):
                counted.append(param)
                opt.step()
                opt.zero_grad()
            q.register_post_accumulate_grad_hook(hook)
    step_in_backward(list(p.model.parameters()), runs)
    step_in_backward(list(p.plain.parameters()), [])
    shards = len(list(p.model.parameters()))
    for step in range(2):
        xl, yl, xg, yg = p.data()
        loss = p.loss(p.model(xl), yl)
        loss.backward()
        ref = p.loss(p.plain(xg), yg)
        ref.backward()
        p.finish(f"step {step} (stepped in backward)", loss, ref)
        if len(runs) != shards * (step + 1):
            ctx.problem(f"step {step}: {len(runs)} hook runs on {shards} shards")
    p.compare_params("after 2 steps stepped in backward")
    with p.model.no_sync():  # reduces nothing, so no hook runs
        p.loss(p.model(xl), yl).backward()
    torch_xla.sync()
    if len(runs) != 2 * shards:
        ctx.problem(f"a no_sync backward ran {len(runs) - 2 * shards} shard hooks")
    for opt in optimizers:
        opt.param_groups.clear()
        opt.state.clear()


def shared_module_names(ctx):
    _trained_and_kept(ctx, "shared_module_names", Pair(ctx, SharedEmbeddingLM, kind="tied"), 3)


def shared_layer_unit(ctx):
    """A block registered in two places and auto-wrapped: one unit in both, which trains as
    unsharded, and every checkpoint names its parameters under both places, as the unwrapped
    model's state dict does (see [Note: a unit under several paths])."""
    import functools
    from xla_fsdp import FSDP
    from xla_fsdp.wrap import transformer_auto_wrap_policy
    p = Pair(ctx, SharedLayerNet, wrap=lambda m: FSDP(m, auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block})))
    if p.model.layers[0] is not p.model.layers[1]:
        ctx.problem("the block registered twice became two modules")
    _trained_and_kept(ctx, "shared_layer_unit", p, 2)


def _trained_and_kept(ctx, name, p, steps):
    """``steps`` steps of ``p`` against unsharded; its full state dict round trips strict,
    and its ranks' state dicts are kept for the test process to consolidate."""
    for step in range(steps):
        p.step(f"step {step}")
    p.compare_params(f"after {steps} steps")
    full = p.model.full_state_dict(rank0_only=False)
    ctx.extra[name] = {
        "model": {k: v.detach().cpu() for k, v in p.model.state_dict().items()},
        "shard_metadata": p.model.get_shard_metadata(), "full": full}
    check_strict_round_trip(ctx, p, full, type(p.plain))


def independent_groups(ctx):
    """``sharding_groups`` of one rank each, as for model parallelism: each group trains a
    model of its own (here each rank from another seed) on its own data, nothing is averaged
    across groups, ``clip_grad_norm_`` gives the norm over every rank (checked in the test
    process) and each group writes its own checkpoint files."""
    import torch_xla
    from xla_fsdp import FSDP
    from xla_fsdp.checkpoint import save_sharded
    kw = dict(sharding_groups=[[0], [1]], sharding_rank=0, sharding_world_size=1)
    cpu = seeded(ctx.rank, Net)
    plain = copy.deepcopy(cpu).to(ctx.device)
    cpu.b1 = FSDP(cpu.b1, **kw)
    model = FSDP(cpu, **kw)
    opt, plain_opt = sgd(model.parameters()), sgd(plain.parameters())
    opt.step()
    norms = []
    for step in range(2):
        x, y = (t.to(ctx.device) for t in batch("net", step + 10 * ctx.rank))
        for o in (opt, plain_opt):
            o.zero_grad()
        loss = loss_fn("net", model(x), y)
        loss.backward()
        total = model.clip_grad_norm_(1e9)
        ref = loss_fn("net", plain(x), y)
        ref.backward()
        mine = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9)
        opt.step()
        plain_opt.step()
        torch_xla.sync()
        norms.append((total.item(), mine.item()))
        if not abs(loss.item() - ref.item()) <= TOL * abs(ref.item()):
            ctx.problem(f"step {step}: loss {loss.item():.7g}, own reference {ref.item():.7g}")
    full = model.full_state_dict(rank0_only=False)
    compare_values(ctx, "after 2 steps", full,
                   {k: v.detach().cpu() for k, v in plain.state_dict().items()})
    path = save_sharded(os.path.join(ctx.extra["tmp_dir"], "groups"), model, opt)
    ctx.extra.setdefault("independent_groups", {})[ctx.rank] = {
        "norms": norms, "path": path, "full": full}
    opt.param_groups.clear()
    opt.state.clear()


SCENARIOS: Dict[str, Callable[[Context], None]] = {
    "leaf_input_hooks": leaf_input_hooks,
    "submodule_backward": submodule_backward,
    "retain_graph": retain_graph,
    "nested_before_root": nested_before_root,
    "dataclass_outputs": dataclass_outputs,
    "freeze_after_wrap": freeze_after_wrap,
    "non_persistent_buffer": non_persistent_buffer,
    "group_member_skipped": group_member_skipped,
    "eval_no_grad": eval_no_grad,
    "load_assign": load_assign,
    "abandoned_no_sync": abandoned_no_sync,
    "optimizer_in_backward": optimizer_in_backward,
    "shared_module_names": shared_module_names,
    "shared_layer_unit": shared_layer_unit,
    "independent_groups": independent_groups,
    "own_parameters_in_forward": own_parameters_in_forward,
    "frozen_for_a_reference_forward": frozen_for_a_reference_forward,
}


def run(rank: int, names: List[str], tmp_dir: str) -> Dict[str, dict]:
    """Every scenario in ``names`` on this rank: {"problems": {name: [str]}, "extra": {...}}."""
    import time
    import torch_xla
    device = torch_xla.device()
    problems: Dict[str, List[str]] = {}
    extra: Dict[str, object] = {"tmp_dir": tmp_dir}
    seconds: Dict[str, float] = {}
    for name in names:
        found: List[str] = []
        start = time.monotonic()
        ctx = Context(rank, device, found, extra)
        try:
            SCENARIOS[name](ctx)
        except Exception as exc:
            found.append(f"raised {describe(exc)}")
        for pair in ctx.pairs:
            pair.retire()
        del ctx
        try:
            torch_xla.sync()  # whatever a failed scenario left traced runs here, on every rank
        except Exception as exc:
            found.append(f"the sync after the scenario raised {describe(exc)}")
        gc.collect()  # units hold reference cycles (hooks): free the scenario's device memory
        seconds[name] = round(time.monotonic() - start, 1)
        problems[name] = list(dict.fromkeys(found))
    return {"problems": problems, "extra": extra, "seconds": seconds}
