"""The collectives rule checked on what runs, not on names (``test_layering`` reads the
code): eager steps (nested units, a scanned stack, ``no_sync``, ``clip_grad_norm_``, and
sharding groups replicated across groups with the optimizer offloaded), full state dicts,
per-rank (also asynchronous), consolidated, DCP and managed checkpoints saved and loaded,
run with every upstream collective, barrier and host meeting wrapped, and each call is
charged to the innermost package module on the stack, and when that is a wrapper in
``_xla/private_api.py``, also to the module that called the wrapper. A step under
``torch.compile`` is watched in the graphs Dynamo hands its backend: each collective node is
charged the same way from the stack Dynamo recorded for it (a wrapper around the op would
be a Python frame inside the trace). Only ``_sharding/collectives.py`` may issue collectives
and barriers, itself or through ``private_api``'s wrappers, and ``_xla/traced_collectives.py``
through those wrappers only; only ``checkpoint/coordination.py`` may meet on the host."""
import os
import sys

import torch
import torch.nn as nn

from xla_fsdp import launch

PRIVATE_API = "xla_fsdp._xla.private_api"
# the module that issues a collective through an upstream call, and for a wrapper of a
# private binding, the module that called the wrapper
EAGER_ISSUERS = {"xla_fsdp._sharding.collectives",
                 f"{PRIVATE_API} <- xla_fsdp._sharding.collectives"}
TRACED_ISSUERS = {f"{PRIVATE_API} <- xla_fsdp._xla.traced_collectives"}
ISSUERS = EAGER_ISSUERS | TRACED_ISSUERS
MEETERS = {"xla_fsdp.checkpoint.coordination"}
# xm's functions and the bindings below them (some of xm's lower through neither)
XM_COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all",
                  "collective_permute", "optimization_barrier_")
XM_MEETINGS = ("rendezvous", "xla_rendezvous", "mesh_reduce")
BINDINGS = ("_xla_all_gather", "_xla_all_gather_out", "_xla_all_gather_coalesced",
            "_xla_all_reduce", "_xla_all_reduce_inplace", "_xla_reduce_scatter",
            "_xla_reduce_scatter_coalesced", "_xla_optimization_barrier_")


def _ours(name: str) -> bool:
    """A package module, the launcher (which stands in for some collectives on virtual
    devices) left out."""
    return name.startswith("xla_fsdp.") and not name.startswith("xla_fsdp.launch")


def _charged(modules) -> str:
    """Who a call is charged to, from the modules of ours on its stack, innermost first:
    the innermost; a wrapper of ``private_api`` together with the module that called it,
    which must be one that builds collectives."""
    modules = [m for m in modules if _ours(m)]
    if not modules:
        return "?"
    if modules[0] == PRIVATE_API:
        after = next((m for m in modules[1:] if m != PRIVATE_API), "?")
        return f"{PRIVATE_API} <- {after}"
    return modules[0]


def _caller() -> str:
    """Who the call being watched is charged to (``_charged``), this test left out."""
    frame, modules = sys._getframe(2), []
    while frame is not None:
        modules.append(frame.f_globals.get("__name__", ""))
        frame = frame.f_back
    return _charged(modules)


def _traced_caller(stack_trace: str) -> str:
    """The innermost module of ours in a stack Dynamo recorded for a graph node (its frames
    outermost first, as a traceback lists them)."""
    import xla_fsdp
    package = os.path.dirname(os.path.dirname(os.path.abspath(xla_fsdp.__file__)))
    modules = []
    for line in stack_trace.splitlines():
        line = line.strip()
        if line.startswith('File "') and line[6:].startswith(package + os.sep):
            path = line[6:line.index('"', 6)]
            modules.append(os.path.relpath(path, package)[:-len(".py")].replace(os.sep, "."))
    return _charged(reversed(modules))


def _watching_backend(seen):
    """torch_xla's backend, first charging every collective in the graphs it is given."""
    from torch._dynamo.backends.registry import lookup_backend
    openxla = lookup_backend("openxla")

    def backend(graph_module, example_inputs):
        graphs = [m.graph for m in graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
        for node in (n for g in graphs for n in g.nodes):  # with autograd.Functions' bodies
            if node.op == "call_function" and "_c10d_functional" in str(node.target):
                seen.add(("traced collective", str(node.target),
                          _traced_caller(node.meta.get("stack_trace") or "")))
        return openxla(graph_module, example_inputs)
    return backend


def _watch(owner, names, kind, seen):
    for name in names:
        original = getattr(owner, name, None)
        if original is None:
            continue

        def watched(*args, _original=original, _name=name, **kwargs):
            seen.add((kind, _name, _caller()))
            return _original(*args, **kwargs)
        setattr(owner, name, watched)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


def run(rank, root):
    import torch_xla
    import torch_xla.core.xla_model as xm
    from xla_fsdp import FSDP, ScannedLayers
    from xla_fsdp.checkpoint import (CheckpointManager, load_consolidated, load_dcp,
                                     load_sharded, save_consolidated, save_dcp, save_sharded)
    seen = set()
    _watch(xm, XM_COLLECTIVES, "collective", seen)
    _watch(xm, XM_MEETINGS, "meeting", seen)
    _watch(torch_xla._XLAC, BINDINGS, "collective", seen)
    device = torch_xla.device()
    torch.manual_seed(0)
    model = nn.Sequential(FSDP(Block()), ScannedLayers(nn.ModuleList([Block(), Block()])),
                          FSDP(nn.Linear(8, 4), flatten_parameters=True)).to(device)
    model = FSDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        if step == 0:   # an accumulation step first
            with model.no_sync():
                model(torch.randn(4, 8, device=device)).square().mean().backward()
        loss = model(torch.randn(4, 8, device=device)).square().mean()
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    full = model.full_state_dict(rank0_only=False)
    model.load_full_state_dict(full)
    prefix = os.path.join(root, "ck")
    save_sharded(prefix, model, opt)
    load_sharded(prefix, model, opt)
    save_sharded(prefix + "_async", model, opt, async_save=True).wait()
    save_consolidated(os.path.join(root, "c.pth"), model, opt)
    load_consolidated(os.path.join(root, "c.pth"), model, opt, first_rank_reads=True)
    save_consolidated(os.path.join(root, "c_dcp"), model, opt, format="dcp")
    load_consolidated(os.path.join(root, "c_dcp"), model, opt)
    save_dcp(os.path.join(root, "dcp"), model, opt)
    load_dcp(os.path.join(root, "dcp"), model, opt)
    manager = CheckpointManager(os.path.join(root, "managed"), on_preemption=False)
    manager.save(1, model, opt)
    manager.restore(model, opt)
    # sharding groups of one rank, replicated across groups (gradients all-reduced between
    # them), the optimizer's state offloaded to the host: their own collectives and copies
    kw = dict(sharding_groups=[[0], [1]], sharding_rank=0, sharding_world_size=1,
              replicate_across_groups=True, offload_optimizer=True)
    hybrid = FSDP(nn.Sequential(FSDP(Block(), **kw), nn.Linear(8, 4)).to(device), **kw)
    hybrid_opt = torch.optim.AdamW(hybrid.parameters(), lr=1e-2)
    for _ in range(2):
        hybrid(torch.randn(4, 8, device=device)).square().mean().backward()
        hybrid.clip_grad_norm_(1.0)
        hybrid_opt.step()
        hybrid_opt.zero_grad()
        torch_xla.sync()
    save_consolidated(os.path.join(root, "hybrid.pth"), hybrid, hybrid_opt)
    save_sharded(os.path.join(root, "hybrid"), hybrid, hybrid_opt)
    load_sharded(os.path.join(root, "hybrid"), hybrid, hybrid_opt)
    torch_xla.sync()
    # a compiled step: its gathers and reductions are traced into the graph
    compiled = FSDP(nn.Sequential(FSDP(Block()), nn.Linear(8, 4)).to(device))
    compiled_opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    step = torch.compile(compiled, backend=_watching_backend(seen))
    step(torch.randn(4, 8, device=device)).square().mean().backward()
    compiled_opt.step()
    torch_xla.sync()
    return sorted(seen)


def test_only_the_collectives_modules_issue_collectives_and_only_coordination_meets(tmp_path):
    seen = launch(run, (str(tmp_path),), num_devices=2)[0]
    kinds = {kind for kind, _, _ in seen}
    assert kinds == {"collective", "meeting", "traced collective"}, seen  # every watch saw
    callers = {(kind, caller) for kind, _, caller in seen}
    wrong = sorted((kind, name, caller) for kind, name, caller in seen
                   if caller not in (MEETERS if kind == "meeting" else ISSUERS))
    assert not wrong, wrong
    assert {c for k, c in callers if k == "collective"} == EAGER_ISSUERS, callers
    assert {c for k, c in callers if k == "traced collective"} == TRACED_ISSUERS, callers
    traced = {name for kind, name, _ in seen if kind == "traced collective"}
    assert {"_c10d_functional.all_gather_into_tensor",
            "_c10d_functional.reduce_scatter_tensor"} <= traced, traced
