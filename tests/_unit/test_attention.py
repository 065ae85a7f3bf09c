"""Attention inside a unit (``_unit/attention.py``): torch's ``scaled_dot_product_attention``
semantics, matmuls in the inputs' dtype and nothing the size of the attention matrix kept in
float32, on CPU; on XLA, float32 attention equal to torch's keeping no probabilities, and
inside bf16 units with activation checkpointing or under ``torch.compile`` (blocks or root),
every matmul of forward, recompute and backward in bf16."""
import contextlib
import re
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from xla_fsdp import launch
from xla_fsdp._unit.attention import attention, enter, install, leave

from ..support.checks import every, nonempty, pairs

B, H, L, S = 2, 4, 6, 7


@contextlib.contextmanager
def inside_unit(enabled: bool = True):
    """The scope a unit's forward holds, for a block of code, unless ``enabled`` is false
    (what a unit's hooks do: ``enter`` and ``leave``)."""
    owner = object()
    if enabled:
        install()
        enter(owner)
    try:
        yield
    finally:
        leave(owner)
MATMULS = {"mm", "bmm", "addmm", "baddbmm"}


def _inputs(dtype, kv_heads=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    return make(B, H, L, 8), make(B, kv_heads, S, 8), make(B, kv_heads, S, 5)


def _mask(kind):
    g = torch.Generator().manual_seed(1)
    if kind == "bool":
        return {"attn_mask": torch.rand(L, S, generator=g) > 0.3}
    if kind == "float":
        return {"attn_mask": torch.randn(B, 1, L, S, generator=g, dtype=torch.float64)}
    if kind == "row_fully_masked":
        keep = torch.rand(L, S, generator=g) > 0.3
        keep[2] = False
        return {"attn_mask": keep}
    return {"is_causal": True} if kind == "causal" else {}


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float", "row_fully_masked"])
def test_float64_inputs_give_torchs_values_and_gradients(mask, gqa):
    # the softmax runs in float32, so float64 inputs agree with torch to float32's rounding
    q, k, v = _inputs(torch.float64, kv_heads=2 if gqa else H)
    kwargs = dict(_mask(mask), scale=0.3, enable_gqa=gqa)
    want = F.scaled_dot_product_attention(q, k, v, **kwargs)
    got = attention(q, k, v, **kwargs)
    grad = torch.randn_like(want)
    for a, b in pairs(torch.autograd.grad(got, (q, k, v), grad),
                    torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_dropout_zeroes_probabilities_and_rescales_the_rest():
    q, k, _ = _inputs(torch.float64)
    eye = torch.eye(S, dtype=torch.float64).expand(B, H, S, S)  # the output is the probabilities
    probs = attention(q, k, eye)
    torch.manual_seed(0)
    dropped = attention(q, k, eye, dropout_p=0.5)
    kept = dropped != 0
    assert 0.2 < kept.double().mean() < 0.8
    torch.testing.assert_close(dropped[kept], 2 * probs[kept], rtol=1e-6, atol=0)


def test_a_mask_and_is_causal_together_are_refused_as_torch_refuses_them():
    q, k, v = _inputs(torch.float64)
    with pytest.raises(ValueError, match="attn_mask or is_causal"):
        attention(q, k, v, attn_mask=torch.ones(L, S, dtype=torch.bool), is_causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_values_and_gradients_are_close_to_float64(dtype):
    q, k, v = _inputs(dtype)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    got = attention(q, k, v, is_causal=True)
    want = F.scaled_dot_product_attention(*exact, is_causal=True)
    assert got.dtype == dtype
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for a, b in pairs(torch.autograd.grad(got, (q, k, v), grad.to(dtype)),
                    torch.autograd.grad(want, exact, grad)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _eager(q, k, v):  # Hugging Face's eager attention
    scores = q @ k.transpose(-1, -2)
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in MATMULS:
            self.dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def _run(path, scope):
    """(matmul dtypes of forward and backward, tensors of the attention matrix's size kept for
    backward, as (dtype, shape)) of ``path`` on bf16 inputs, in the scope or not."""
    q, k, v = _inputs(torch.bfloat16, seed=3)
    kept = []

    def pack(t):
        if tuple(t.shape[-2:]) == (L, S):
            kept.append((t.dtype, tuple(t.shape)))
        return t

    with _Matmuls() as matmuls, inside_unit(scope), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = path(q, k, v)
    with matmuls:
        out.float().sum().backward()
    return matmuls.dtypes, kept


@pytest.mark.parametrize("path", [_sdpa, _eager], ids=["sdpa", "eager"])
def test_in_the_scope_matmuls_stay_bf16_and_no_float32_attention_matrix_is_kept(path):
    """sdpa keeps no attention matrix at all (its probabilities are computed again in
    backward); Hugging Face's eager path, whose matmul is its own, keeps them in bf16."""
    dtypes, kept = _run(path, scope=True)
    assert dtypes == {torch.bfloat16}, dtypes
    assert (kept == []) if path is _sdpa else every(d == torch.bfloat16 for d, _ in kept), kept
    # what the scope replaces: torch's sdpa casts to float32; the eager softmax keeps float32
    dtypes, kept = _run(path, scope=False)
    assert any(d == torch.float32 for d, _ in kept), kept
    assert path is _eager or torch.float32 in dtypes, dtypes


def test_the_scope_passes_float32_through_and_holds_on_its_thread_only():
    import threading
    torchs = torch._C._nn.scaled_dot_product_attention
    q, k, v = _inputs(torch.float32)
    bq, bk, bv = _inputs(torch.bfloat16)
    elsewhere = {}
    with inside_unit():
        inside = F.scaled_dot_product_attention(q, k, v)
        softmax = F.softmax(q, dim=-1, dtype=torch.float32)
        thread = threading.Thread(target=lambda: elsewhere.update(
            out=F.scaled_dot_product_attention(bq, bk, bv)))
        thread.start()
        thread.join()
        # a router's softmax (2-D), or one not along the keys, is torch's
        assert F.softmax(bq[0, 0], -1, dtype=torch.float32).grad_fn.name() == "SoftmaxBackward0"
        assert F.softmax(bq, 2, dtype=torch.float32).grad_fn.name() == "SoftmaxBackward0"
        assert F.softmax(bq, -1, dtype=torch.float32).grad_fn.name() == "_SoftmaxKeptLowBackward"
    assert torch.equal(inside, torchs(q, k, v))
    assert softmax.grad_fn.name() == "SoftmaxBackward0"
    assert torch.equal(elsewhere["out"], torchs(bq, bk, bv))
    assert torch.equal(F.scaled_dot_product_attention(bq, bk, bv), torchs(bq, bk, bv))
    with inside_unit(enabled=False):
        assert F.softmax(bq, -1, dtype=torch.float32).grad_fn.name() == "SoftmaxBackward0"


def _scripted(x: torch.Tensor) -> torch.Tensor:
    return (F.softmax(x, dim=-1, dtype=torch.float32)
            + F.scaled_dot_product_attention(x, x, x, is_causal=True, scale=0.5))


def test_torchscript_compiles_the_wrapped_functions_as_torchs_operators():
    install()
    x = torch.randn(2, 3, 4)
    want = torch.softmax(x, -1) + torch._C._nn.scaled_dot_product_attention(
        x, x, x, is_causal=True, scale=0.5)
    assert torch.equal(torch.jit.script(_scripted)(x), want)


def _count_dots(hlo, into):
    for dtype in re.findall(r"= (\w+)\[[^\]]*\]\S* dot\(", hlo):
        into[dtype] = into.get(dtype, 0) + 1


# the ranks are threads of one process, sharing the compile cache: whichever reaches a region
# first compiles it, under the placement its thread is running
_COMPILED_DOTS = {}
_PLACEMENT = threading.local()


def _read_compiled_dots():
    """Counts the dots of every program the openxla bridge compiles (read as it warms its
    cache) under the compiling thread's placement; installed once per process."""
    import torch_xla
    warm_up = torch_xla._XLAC._xla_warm_up_cache
    if getattr(warm_up, "reads_dots", False):
        return

    def reading_dots(tensors, devices):
        placement = getattr(_PLACEMENT, "name", None)
        if placement is not None:
            _count_dots(torch_xla._XLAC._get_xla_tensors_hlo(tensors),
                        _COMPILED_DOTS.setdefault(placement, {}))
        return warm_up(tensors, devices)
    reading_dots.reads_dots = True
    torch_xla._XLAC._xla_warm_up_cache = reading_dots


class _TorchCheckpointed(torch.nn.Module):
    """torch's non-reentrant checkpoint inside the unit (as Hugging Face 5's decoder layers
    take it): its recompute, in backward, bypasses the unit's hooks."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.module, *args, use_reentrant=False)


def _bf16_step_dots(rank):
    """{placement: {dtype: count}} of the dots in a bf16 step of the attention model.

    Eager, in checkpointed units: the HLO of forward, recompute and backward, with
    ``checkpoint_module`` inside each unit (its recompute bypasses the unit's hooks),
    torch's ``checkpoint_wrapper`` around each (its recompute runs the unit's forward again,
    as Hugging Face 4's gradient checkpointing does) and torch's checkpoint inside each (its
    recompute bypasses the hooks, as Hugging Face 5's does).

    Under ``torch.compile``: every program the openxla bridge compiles over three steps (read
    as it warms its cache), with the blocks compiled inside their units and with the root
    compiled around them (whose hooks Dynamo traces). Their losses too, and the eager
    model's, from the same weights and batches."""
    import functools

    import torch_xla
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from tests.support.models import Block, batch, build_model, loss_fn
    from xla_fsdp import FSDP, checkpoint_module
    from xla_fsdp.wrap import transformer_auto_wrap_policy
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    device = torch_xla.device()
    results = {}
    for where, unit in (("inside", lambda m, *a, **k: FSDP(checkpoint_module(m), *a, **k)),
                        ("around", lambda m, *a, **k: checkpoint_wrapper(FSDP(m, *a, **k))),
                        ("torch_inside", lambda m, *a, **k: FSDP(_TorchCheckpointed(m), *a, **k))):
        torch.manual_seed(0)
        model = FSDP(build_model("attention"), compute_dtype=torch.bfloat16,
                     auto_wrap_policy=policy, auto_wrapper_callable=unit)
        x, y = (t.to(device) for t in batch("attention", 0))
        loss_fn("attention", model(x), y).backward()
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([p.grad for p in model.parameters()])
        torch_xla.sync()
        results[where] = {}
        _count_dots(hlo, results[where])

    _read_compiled_dots()
    bf16 = {"compute_dtype": torch.bfloat16}
    for placement in ("eager", "compile_blocks", "compile_root"):
        torch.manual_seed(0)
        net = build_model("attention")
        compile_block = (lambda b: torch.compile(b, backend="openxla")) \
            if placement == "compile_blocks" else (lambda b: b)
        net.b1, net.b2 = FSDP(compile_block(net.b1), **bf16), FSDP(compile_block(net.b2), **bf16)
        model = FSDP(net, **bf16)
        if placement == "compile_root":
            model = torch.compile(model, backend="openxla")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _PLACEMENT.name = placement
        losses = []
        for step in range(3):
            x, y = (t.to(device) for t in batch("attention", step))
            loss = loss_fn("attention", model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
            losses.append(loss.item())
        _PLACEMENT.name = None
        results[placement] = dict(_COMPILED_DOTS.get(placement, {}), losses=losses)
    return results


def test_every_matmul_of_a_bf16_step_is_bf16_checkpointed_or_compiled():
    # outside the scope, in a recompute outside it, or under torch.compile when Dynamo traced
    # torch's functions instead of the scope's, sdpa's matmuls would be float32
    results = launch(_bf16_step_dots, num_devices=2)
    assert results[0] == results[1], results
    eager_losses = results[0].pop("eager")["losses"]
    for where, dots in nonempty(results[0].items(), "placements but eager"):
        losses = dots.pop("losses", eager_losses)
        assert set(dots) == {"bf16"}, (where, dots)
        # eager: qkv, out, up and down of 2 blocks and the head, 3 dots each (forward and
        # backward), 2 attention matmuls of 2 blocks, 3 each, and a recompute's forward;
        # compiled: at least each block's 6 forward matmuls (the blocks' programs)
        least = 12 if where.startswith("compile") else 3 * 9 + 3 * 4
        assert dots["bf16"] >= least, (where, dots)
        # the compiled steps train as the eager one does, within the bf16 parity bound
        for step, (got, want) in enumerate(pairs(losses, eager_losses, what="losses")):
            assert abs(got - want) <= 3e-2 * abs(want), (where, step, got, want)


def _float32_on_xla(rank):
    """{mask: (torch's output and gradients, the scope's, the attention-matrix-sized tensors
    each kept for backward, whether the scope's backward HLO has a barrier)} for float32 XLA
    tensors."""
    import torch_xla
    device = torch_xla.device()
    results = {}
    for mask in ("none", "causal", "bool", "float", "row_fully_masked"):
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                  for k, v in _mask(mask).items()}
        if mask == "float":
            kwargs["attn_mask"] = kwargs["attn_mask"].float()
        got = []
        for scope in (False, True):
            q, k, v = (t.detach().to(device).requires_grad_() for t in _inputs(torch.float32))
            kept = []

            def pack(t):   # the user's mask is theirs to keep
                if tuple(t.shape[-2:]) == (L, S) and t is not kwargs.get("attn_mask"):
                    kept.append(tuple(t.shape))
                return t
            with inside_unit(scope), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(grads))
            got.append(([t.cpu() for t in (out, *grads)], kept, "opt-barrier" in hlo))
        (want, kept_torch, _), (ours, kept_ours, barrier) = got
        results[mask] = (want, ours, kept_torch, kept_ours, barrier)
    # dropout, with a scale: in the scope it is torch's own, from the same random state
    import torch_xla.core.xla_model as xm
    dropped = []
    for scope in (False, True):
        q, k, v = (t.detach().to(device).requires_grad_() for t in _inputs(torch.float32))
        xm.set_rng_state(7)
        with inside_unit(scope):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True,
                                                 scale=0.5)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        dropped.append([t.cpu() for t in (out, *grads)])
    return results, dropped


def test_float32_xla_attention_in_the_scope_is_torchs_and_keeps_no_probabilities():
    """On XLA torch's sdpa runs its math path and keeps the float32 probabilities for
    backward; in the scope the same values and gradients, to float32's rounding, come from
    a computation that keeps query, key, value, the output and the rows' log-sum-exp, and
    computes the probabilities again behind a barrier."""
    results, dropped = launch(_float32_on_xla, num_devices=1)[0]
    for mask, (want, ours, kept_torch, kept_ours, barrier) in nonempty(results.items(),
                                                                        "masks"):
        for a, b in pairs(ours, want):
            torch.testing.assert_close(a, b, msg=lambda m: f"{mask}: {m}")
        assert kept_torch and kept_ours == [] and barrier, (mask, kept_torch, kept_ours)
    # attention dropout (GPT-2's default attn_pdrop) and a scale: torch's own values
    for a, b in pairs(*dropped):
        torch.testing.assert_close(a, b)
    assert (dropped[0][0] == 0).any()

