"""The torch.compile placements, trained in one launch next to the same FSDP model run
eagerly and next to the model trained unsharded on one device (``unsharded``, once per
launch): each setting returns its losses, its full parameters and, per step, how many
frames Dynamo compiled and how many graphs XLA compiled (with Dynamo's guard failures, the
reasons for any recompilation).

Only rank 0 resets Dynamo between settings: the device threads share Dynamo's cache, so a
reset on another rank would drop what rank 0 compiled for all of them (on separate hosts
every process resets its own).
"""
import functools

import torch

from .models import STEPS, Block, Net, TiedLM, batch, loss_fn

COMPILE_STEPS = 6
WARM_UP = 3  # steps after which nothing may compile

PLACEMENTS = ("compile_root", "compile_blocks", "compile_blocks_autowrap",
              "compile_autowrapped")
# name: (placement, fsdp kwargs, extra)
SETTINGS = {
    "eager": ("eager", {}, {}),
    **{p: (p, {}, {}) for p in PLACEMENTS},
    "eager_bf16": ("eager", {"compute_dtype": torch.bfloat16}, {}),
    "compile_root_bf16": ("compile_root", {"compute_dtype": torch.bfloat16}, {}),
    "eager_checkpointed": ("eager", {}, {"checkpoint": True}),
    "compile_root_checkpointed": ("compile_root", {}, {"checkpoint": True}),
    "compile_blocks_checkpointed": ("compile_blocks", {}, {"checkpoint": True}),
    "eager_no_sync": ("eager", {}, {"no_sync": True}),
    "compile_root_no_sync": ("compile_root", {}, {"no_sync": True}),
    "compile_blocks_no_sync": ("compile_blocks", {}, {"no_sync": True}),
    # the optimizer on the host: the gradients leave the device at the end of backward
    "eager_offload": ("eager", {"offload_optimizer": True}, {}),
    "compile_root_offload": ("compile_root", {"offload_optimizer": True}, {}),
    "compile_blocks_offload": ("compile_blocks", {"offload_optimizer": True}, {}),
    # a Hugging Face Llama from the real-architecture suite, its decoder layers the units
    "llama_eager": ("eager", {}, {"llama": True}),
    "llama_compile_root": ("compile_autowrapped", {}, {"llama": True}),
    "llama_compile_blocks": ("compile_blocks_autowrap", {}, {"llama": True}),
}
assert COMPILE_STEPS <= STEPS


def _compile(module):
    return torch.compile(module, backend="openxla")


def build(placement, kwargs, extra):
    from xla_fsdp import FSDP, checkpoint_module, transformer_auto_wrap_policy
    if extra.get("llama"):
        return _build_llama(placement, kwargs)
    torch.manual_seed(0)
    net = Net()
    block = checkpoint_module if extra.get("checkpoint") else (lambda b: b)
    if placement in ("eager", "compile_root"):
        net.b1, net.b2 = FSDP(block(net.b1), **kwargs), FSDP(block(net.b2), **kwargs)
        model = FSDP(net, **kwargs)
        return _compile(model) if placement == "compile_root" else model
    if placement == "compile_blocks":
        net.b1 = FSDP(_compile(block(net.b1)), **kwargs)
        net.b2 = FSDP(_compile(block(net.b2)), **kwargs)
        return FSDP(net, **kwargs)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    if placement == "compile_blocks_autowrap":
        net.b1, net.b2 = _compile(net.b1), _compile(net.b2)
        return FSDP(net, auto_wrap_policy=policy, **kwargs)
    assert placement == "compile_autowrapped", placement
    return _compile(FSDP(net, auto_wrap_policy=policy, **kwargs))


def _build_llama(placement, kwargs):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from xla_fsdp import FSDP, transformer_auto_wrap_policy

    from . import hf_architectures
    model = hf_architectures.build("llama")
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={LlamaDecoderLayer})
    if placement == "compile_blocks_autowrap":
        layers = model.model.layers
        for i in range(len(layers)):
            layers[i] = _compile(layers[i])
    model = FSDP(model, auto_wrap_policy=policy, **kwargs)
    return _compile(model) if placement == "compile_autowrapped" else model


def _loss(model, extra, x, y, device):
    if extra.get("llama"):
        return model(input_ids=x.to(device), labels=y.to(device)).loss
    return loss_fn("net", model(x.to(device)), y.to(device))


def _batch(extra, step):
    if extra.get("llama"):
        from .hf_architectures import causal_lm_batch
        b = causal_lm_batch("llama", step)
        return b["input_ids"], b["labels"]
    return batch("net", step)


def counts():
    import torch_xla.debug.metrics as met
    from torch._dynamo.utils import counters
    return counters["frames"]["ok"], met.counter_value("UncachedCompile") or 0


def executions():
    """XLA programs run so far by every rank of the process (the metric is process-wide)."""
    import torch_xla.debug.metrics as met
    data = met.metric_data("ExecuteTime")
    return data[0] if data else 0


def settled_executions():
    """``executions()`` once every rank's programs so far have run. The metric counts a program
    when it ends, so a peer's program still running as a rank reads it would fall on the
    wrong side of the window (under load: 11 of 12 at N=4); the second rendezvous keeps a
    rank that reads early from counting a peer's next program."""
    import torch_xla.core.xla_model as xm
    xm.wait_device_ops()
    xm.rendezvous("executions: every rank's programs have run")
    count = executions()
    xm.rendezvous("executions: every rank has counted")
    return count


def guard_failures():
    from torch._dynamo.utils import guard_failures as failures
    return {f"{code.co_filename}:{code.co_firstlineno} {code.co_name}": list(reasons)
            for code, reasons in failures.items()}


def train(rank, world, model, extra):
    import torch_xla
    device = torch_xla.device()
    unit = getattr(model, "_orig_mod", model)  # the FSDP root, compiled or not
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, per_step = [], []
    for step in range(COMPILE_STEPS):
        if step == WARM_UP:
            executed = settled_executions()
        before = counts()
        x, y = _batch(extra, step)
        local = len(x) // world
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        opt.zero_grad()
        if extra.get("no_sync"):  # two micro-batches, the first accumulated unreduced
            half = local // 2
            with unit.no_sync():
                _loss(model, extra, x[:half], y[:half], device).div(2).backward()
            loss = _loss(model, extra, x[half:], y[half:], device).div(2)
        else:
            loss = _loss(model, extra, x, y, device)
        loss.backward()
        opt.step()
        torch_xla.sync()
        losses.append(loss.item())
        after = counts()
        per_step.append((after[0] - before[0], after[1] - before[1]))
    per_rank_step = (settled_executions() - executed) / (world * (COMPILE_STEPS - WARM_UP))
    full = {k: v.cpu() for k, v in unit.full_state_dict(rank0_only=False).items()}
    return losses, full, per_step, per_rank_step


def unsharded(extra):
    """The reference: the same model trained unsharded on this rank's device, on the global
    batch (the ranks' mean loss; their averaged gradient, with or without ``no_sync``)."""
    import torch_xla
    device = torch_xla.device()
    if extra.get("llama"):
        from . import hf_architectures
        model = hf_architectures.build("llama").to(device)
    else:
        torch.manual_seed(0)
        model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(COMPILE_STEPS):
        x, y = _batch(extra, step)
        opt.zero_grad()
        loss = _loss(model, extra, x, y, device)
        loss.backward()
        opt.step()
        torch_xla.sync()
        losses.append(loss.item())
    return {"losses": losses, "full": {k: v.cpu() for k, v in model.state_dict().items()}}


def run_settings(rank, world, names):
    import torch._dynamo
    out = {"unsharded": unsharded(SETTINGS[names[0]][2])}
    for name in names:
        placement, kwargs, extra = SETTINGS[name]
        if rank == 0:
            torch._dynamo.reset()
        losses, full, per_step, runs = train(rank, world, build(placement, kwargs, extra), extra)
        out[name] = {"losses": losses, "full": full, "per_step": per_step,
                     "executions": runs, "guard_failures": guard_failures()}
    return out


def refusals(rank):
    """The placements that cannot work, each with the error it gets."""
    import torch_xla

    from xla_fsdp import FSDP, ScannedLayers

    from .models import Stack
    device = torch_xla.device()
    x, _ = batch("net", 0)
    out = {}

    def attempt(name, make_and_run):
        try:
            make_and_run()
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - the message is what the test reads
            out[name] = f"{type(exc).__name__}: {exc}"
        torch_xla.sync()

    def fullgraph():  # on the graph-break path (the optimizer on the host)
        net = Net()
        net.b1 = FSDP(net.b1, offload_optimizer=True)
        net.b2 = FSDP(net.b2, offload_optimizer=True)
        model = FSDP(net, offload_optimizer=True)
        torch.compile(model, backend="openxla", fullgraph=True)(x.to(device))

    def fullgraph_traced():  # the gathers traced into the graph: one graph, it works
        net = Net()
        net.b1, net.b2 = FSDP(net.b1), FSDP(net.b2)
        torch.compile(FSDP(net), backend="openxla", fullgraph=True)(x.to(device)).sum().backward()

    def fullgraph_inside_block():  # the placement the error points to: it works
        net = Net()
        net.b1 = FSDP(torch.compile(net.b1, backend="openxla", fullgraph=True))
        net.b2 = FSDP(torch.compile(net.b2, backend="openxla", fullgraph=True))
        FSDP(net)(x.to(device)).sum().backward()

    def scanned():
        stack = Stack()
        stack.layers = ScannedLayers(stack.layers)
        _compile(FSDP(stack))(x.to(device))

    def group_of_compiled():
        net = Net()
        FSDP([_compile(net.b1), _compile(net.b2)])

    def vocab_parallel():  # the tables' collectives are eager
        lm = TiedLM()
        tokens, _ = batch("tied", 0)
        _compile(FSDP(lm, vocab_parallel=True))(tokens.to(device))

    for name, fn in (("fullgraph", fullgraph), ("fullgraph_traced", fullgraph_traced),
                     ("fullgraph_inside_block", fullgraph_inside_block),
                     ("scanned", scanned), ("group_of_compiled", group_of_compiled),
                     ("vocab_parallel", vocab_parallel)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        attempt(name, fn)
    out["dropout"] = _compiled_dropout(device)
    return out


def _compiled_dropout(device):
    """The means of a compiled unit's dropout (p = 0.3) of ones and of its input's gradient:
    1 in expectation ([Note: dropout under torch.compile])."""
    from xla_fsdp import FSDP

    class Drop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.drop = torch.nn.Dropout(0.3)

        def forward(self, x):
            return self.drop(x + 0 * self.lin(x).sum())

    torch._dynamo.reset()
    ones = torch.ones(2048, 8, device=device, requires_grad=True)
    y = _compile(FSDP(Drop()))(ones)
    y.sum().backward()
    return y.mean().item(), ones.grad.mean().item()


def traced_programs(rank, world):
    """``torch.compile(root)`` over two block units, on the traced path. "saved": the shapes
    the forward program hands to the backward one, with the blocks resharding after forward
    (ZeRO-3) and keeping their parameters (``reshard_after_forward=False``), AOTAutograd's
    partition read through a backend that records the forward graph's outputs and then
    compiles as openxla does. "backward": rank 0's backward program as torch_xla's bridge
    compiles it (the same on every rank)."""
    import contextlib

    import torch_xla
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.torchxla import openxla_eval_boxed

    from xla_fsdp import FSDP
    from scripts.bench.compiled_programs import compiled_programs
    device = torch_xla.device()
    out = {"saved": {}}
    for reshard in (True, False):
        recorded = []

        def forward_compiler(gm, example, recorded=recorded):
            (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
            recorded.extend(tuple(o.meta["val"].shape) for o in outputs
                            if hasattr(o, "meta") and "val" in o.meta)
            return openxla_eval_boxed(gm, example)

        if rank == 0:
            torch._dynamo.reset()
        torch.manual_seed(0)
        net = Net()
        net.b1 = FSDP(net.b1, reshard_after_forward=reshard)
        net.b2 = FSDP(net.b2, reshard_after_forward=reshard)
        model = torch.compile(FSDP(net), backend=aot_autograd(fw_compiler=forward_compiler))
        x, y = batch("net", 0)
        with compiled_programs() if rank == 0 and reshard else contextlib.nullcontext([]) \
                as programs:
            loss_fn("net", model(x.to(device)), y.to(device)).backward()
            torch_xla.sync()
        out["saved"][reshard] = recorded
        if rank == 0 and reshard:
            out["backward"] = programs[1]
    return out
