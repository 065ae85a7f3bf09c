"""The compiled training step updates the shards and the optimizer state in place: XLA pairs
every donated buffer with the output that replaces it, so it copies none of them (one launch
at N = 2, reading XLA's optimized module). Without ``donation_order`` torch_xla 2.9 pairs
them by size and order, and the same step copied every shard and AdamW moment in and out.
"""
import glob
import os
import re
from unittest import mock

import pytest
import torch
import torch.nn as nn

from xla_fsdp import launch
from ..support.checks import every

STEPS = 4


def train(rank, foreach, scaled=False, adafactor=False):
    import torch_xla
    from xla_fsdp import FSDP, allow_per_shard_statistics
    torch.manual_seed(0)
    # several tensors share a size (the 32x32 weights, the biases and norms of 32), which
    # is where a pairing by size goes wrong
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(),
                          nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 8))
    model[3], model[5] = FSDP(model[3]), FSDP(model[5])
    root = FSDP(model)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2, foreach=foreach) if not adafactor \
        else allow_per_shard_statistics(torch.optim.Adafactor(root.parameters(), lr=1e-2))
    scaler = torch.amp.GradScaler("xla") if scaled else None
    device = torch_xla.device()
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)
        opt.zero_grad(set_to_none=True)
        loss = root(torch.randn(4, 16, generator=g).to(device)).pow(2).mean()
        if scaler:   # its step is two programs; the last one compiled is the update
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        torch_xla.sync()
        losses.append(loss.item())
    return losses


def train_pair(rank):
    """A generator and a discriminator, two roots, the discriminator's parameters split
    between two optimizers: the generator forwards first, the discriminator steps first. The
    generator's first layer is frozen and left out of its optimizer, and the discriminator's
    first layer has its sizes."""
    import torch_xla
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32),
                        nn.Linear(32, 16))
    gen[0].requires_grad_(False)
    gen[3] = FSDP(gen[3])
    gen = FSDP(gen)
    disc = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 1))
    disc[2] = FSDP(disc[2])
    disc = FSDP(disc)
    params = list(disc.parameters())
    opts_d = [torch.optim.AdamW(params[:3], lr=1e-2), torch.optim.AdamW(params[3:], lr=1e-3)]
    opt_g = torch.optim.AdamW([p for p in gen.parameters() if p.requires_grad], lr=1e-2)
    device = torch_xla.device()
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)
        noise, real = (torch.randn(4, 16, generator=g).to(device) for _ in range(2))
        for opt in opts_d + [opt_g]:
            opt.zero_grad(set_to_none=True)
        fake = gen(noise)
        (disc(real).mean() - disc(fake.detach()).mean()).backward()
        for opt in opts_d:
            opt.step()
        disc(fake).mean().backward()
        opt_g.step()
        torch_xla.sync()
    return True


def _modules(dump):
    """The optimized modules compiled, in the order they were compiled."""
    modules = sorted(glob.glob(os.path.join(dump, "*cpu_after_optimizations.txt")),
                     key=lambda p: int(re.search(r"module_(\d+)", p).group(1)))
    return [open(m).read() for m in modules]


def _entry_parameters(hlo):
    entry = hlo[hlo.index("\nENTRY "):]
    return len(re.findall(r" parameter\(\d+\)", entry[:entry.index("\n}")]))


def _last_step_module(dump):
    return _modules(dump)[-1]


def _step_module(dump, fn, args):
    # aliasing and copies are decided by XLA's HLO passes, before the code generation the
    # suite's flags make quick (tests/conftest.py)
    env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                        f"--xla_dump_hlo_as_text"}
    with mock.patch.dict(os.environ, env):
        out = launch(fn, args, num_devices=2)
    hlo = _last_step_module(str(dump))
    aliases = re.findall(r"\{\d+\}: \(\d+, \{\}, may-alias\)", hlo.splitlines()[0])
    return out, len(aliases), re.findall(r"= \S+ copy\(%p[\d.]+\)", hlo)


@pytest.mark.slow
def test_step_updates_shards_and_optimizer_state_in_place(tmp_path):
    for foreach in (False, True):
        losses, aliases, copied = _step_module(tmp_path / f"foreach_{foreach}", train,
                                               (foreach,))
        assert every(l[-1] < l[0] for l in losses.values()), losses
        # every shard and its two AdamW moments are donated and replaced
        shards = 10  # 4 linear weights + 4 biases + the norm's weight and bias
        assert aliases == 3 * shards, (foreach, aliases)
        assert copied == [], (foreach, copied)
    # GradScaler cuts the step before its flags are read: the update runs as a program of
    # its own ([Note: an update that runs as a program of its own]), which reads the
    # gradients too; only its two scalars (the growth tracker, the scale) are copied
    losses, aliases, copied = _step_module(tmp_path / "scaled", train, (False, True))
    assert every(l[-1] < l[0] for l in losses.values()), losses
    assert aliases == 4 * shards + 2, aliases
    assert [c.split(" copy")[0] for c in copied] == ["= s32[]", "= f32[]"], copied
    # torch's Adafactor reads each parameter's and update's norm on the host: cut before
    # its first read, its update pinned without the reads passing through the pin. Each
    # (flat) shard has one state tensor; its step count stays on the host
    losses, aliases, copied = _step_module(tmp_path / "adafactor", train, (False, False, True))
    assert every(l[-1] < l[0] for l in losses.values()), losses
    assert aliases == 3 * shards, aliases
    assert copied == [], copied
    # the reads' programs (they donate nothing) take the tensors they read, not every
    # buffer the pin numbers (30 each when the pin sat on the tensors themselves)
    reads = [_entry_parameters(m) for m in _modules(tmp_path / "adafactor")
             if "may-alias" not in m.splitlines()[0]]
    assert reads and max(reads) < shards, reads


@pytest.mark.slow
def test_two_roots_three_optimizers_and_frozen_shards_copy_nothing(tmp_path):
    """[Note: every optimizer's gradients after every donor]: each optimizer's hook reissued
    only its own gradients, and this step copied 12 buffers; [Note: shards no optimizer holds
    are donors too]: the frozen shards were neither pinned nor reissued, 6 more copies."""
    _, aliases, copied = _step_module(tmp_path, train_pair, ())
    # the generator's last 2 linears and norm, the discriminator's 3 linears, with their
    # AdamW moments; the frozen layer's weight and bias; the step's two batches
    assert aliases == 3 * 12 + 2 + 2, aliases
    assert copied == [], copied


def test_optimizers_are_pinned_in_the_order_they_first_stepped_shards():
    # every rank must trace the same step graph: an order that follows object addresses (a
    # WeakSet's) differs between ranks once two optimizers have stepped shards
    from xla_fsdp._xla import donation_order
    optimizers = [torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1) for _ in range(24)]
    for opt in reversed(optimizers[::2]):
        donation_order.reissue_in_order(lambda p: True, opt)
    for opt in optimizers[1::2]:
        donation_order.reissue_in_order(lambda p: True, opt)
    order = [o for o in donation_order._optimizers if any(o is p for p in optimizers)]
    assert order == list(reversed(optimizers[::2])) + optimizers[1::2]


def _earlier_model_freed_midway(rank):
    """A model with a frozen layer trained, kept, then freed while another trains: graphs
    compiled by the second model after its second step."""
    import gc
    import torch_xla
    from xla_fsdp import FSDP
    device = torch_xla.device()

    def trained(freeze, steps, then=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
        model[0].requires_grad_(not freeze)
        model = FSDP(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        graphs = 0
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            model(torch.ones(4, 16, device=device)).pow(2).mean().backward()
            opt.step()
            torch_xla.sync()
            if step == 1:
                graphs = torch_xla._XLAC._xla_get_num_cached_compilation_graph()
            if step == 2 and then is not None:
                then()
        return model, torch_xla._XLAC._xla_get_num_cached_compilation_graph() - graphs

    kept = [trained(True, 2)[0]]
    return trained(False, 6, lambda: (kept.clear(), gc.collect()))[1]


def test_a_model_no_longer_run_leaves_the_step_alone():
    """[Note: shards no optimizer holds are donors too]: only the roots that ran since an
    optimizer's last step have their shards reissued by it; an earlier model's frozen shards
    were, until the garbage collector freed it, and the step then compiled again."""
    assert launch(_earlier_model_freed_midway, (), num_devices=2) == {0: 0, 1: 0}


def _left_behind(rank):
    """Gradient accumulation over more micro-batches than the patience, then a fine-tuning's
    two phases on another model: its last layer alone, then every layer with a new
    optimizer, the first kept alive, then an evaluation. Returns whether the accumulating
    optimizer is still pinned at the end of its second cycle, the graphs compiled by the
    accumulation's later cycles, the first optimizer's state, and the graphs compiled by the
    evaluation and the training step after it."""
    import torch_xla
    from xla_fsdp import FSDP
    from xla_fsdp._xla.donation_order import _PATIENCE, _optimizers
    device = torch_xla.device()
    micro = _PATIENCE + 4

    def loss(model, step):
        g = torch.Generator().manual_seed(100 * rank + step)
        return model(torch.randn(4, 16, generator=g).to(device)).pow(2).mean()

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(16, 32), nn.GELU(), FSDP(nn.Linear(32, 32)),
                               nn.Linear(32, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for cycle in range(4):
        if cycle == 2:
            graphs = torch_xla._XLAC._xla_get_num_cached_compilation_graph()
        for step in range(micro):
            loss(model, step).backward()
            torch_xla.sync()
        # the second cycle: the forwards since its first step are past the patience, within
        # the gap learnt there
        if cycle == 1:
            still_pinned = _optimizers[opt].still_stepping(device)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_xla.sync()
    accumulated = torch_xla._XLAC._xla_get_num_cached_compilation_graph() - graphs

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(16, 32), nn.GELU(), FSDP(nn.Linear(32, 32)),
                               nn.Linear(32, 8)))
    params = list(model.parameters())
    first = torch.optim.AdamW(params[-2:], lr=1e-2)
    second = torch.optim.AdamW(params, lr=1e-3)
    for step in range(2 + _PATIENCE + 3):
        opt = first if step < 2 else second
        opt.zero_grad(set_to_none=True)
        loss(model, step).backward()
        opt.step()
        torch_xla.sync()
    # an evaluation longer than the patience, then a training step: the evaluation's graph
    # is new, the step's is the one above
    graphs = torch_xla._XLAC._xla_get_num_cached_compilation_graph()
    with torch.no_grad():
        for step in range(_PATIENCE + 2):
            loss(model, step)
            torch_xla.sync()
    second.zero_grad(set_to_none=True)
    loss(model, 0).backward()
    second.step()
    torch_xla.sync()
    evaluated = torch_xla._XLAC._xla_get_num_cached_compilation_graph() - graphs
    return still_pinned, accumulated, len(first.state), evaluated


@pytest.mark.slow
def test_an_optimizer_left_behind_is_no_longer_pinned(tmp_path):
    """[Note: an optimizer left behind is not pinned]: the first phase's optimizer, alive,
    kept its state in every later step, and this step copied 9 buffers; accumulation over
    more micro-batches than the patience, and an evaluation longer than it, still compile
    nothing new once it is learnt."""
    out, aliases, copied = _step_module(tmp_path, _left_behind, ())
    # and an evaluation compiles its own graph only: it is not counted as forwards the
    # training optimizer went without a step
    assert out == {0: (True, 0, 2, 1), 1: (True, 0, 2, 1)}, out
    # the 3 linears' weight and bias shards with their AdamW moments
    assert aliases == 3 * 6, aliases
    assert copied == [], copied
