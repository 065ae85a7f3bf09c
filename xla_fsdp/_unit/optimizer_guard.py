"""What every optimizer step checks and records for FSDP shards.

Installed as global optimizer step hooks (``process_effects``): before a step, refuse what
would train silently wrong (an optimizer over the parameters FSDP replaced, a step after a
``no_sync`` backward whose gradients were never reduced, ``xm.optimizer_step`` or
accelerate averaging the already-sharded gradients across ranks, and at an optimizer's
first step anything in the pending graph that all-reduces reduced gradients again or
scales them by one rank's own norm, see [Note: auditing reduced gradients], and an optimizer
whose update reads the whole tensor, see [Note: optimizers that read the whole tensor]);
after it, count the update of each shard it stepped (see ``ShardGroup.generation``).

[Note: optimizers that read the whole tensor]
FSDP's optimizer steps shards, so it trains like the unsharded model when each element's
update depends only on that element's gradient and state: SGD, Adam, AdamW, Adagrad,
RMSprop, Adamax, NAdam, RAdam, Rprop, ASGD, Adadelta. Some read the whole tensor: Adafactor
factors a matrix's second moment into row and column means and scales its step by the
parameter's and the update's RMS; Muon orthogonalizes the matrix; LBFGS works on every
parameter at once. On a shard they take those over this rank's slice (a flat shard is not
even a matrix), and each rank steps by statistics the unsharded model never computes: the
training differs, silently (torch's Adafactor on a two-block model at N=2: the second
step's loss 4.5e-4 off with row-block shards, 1.7e-3 with flat ones). Those known by
name are refused at their first step over a shard that is not a whole parameter, before
any update; any other optimizer's first update is read from its graph (see [Note: auditing
an optimizer's update]: LAMB, LARS, Shampoo, SOAP of other libraries) and, if it reads
more than each element, put back and refused.
``allow_per_shard_statistics(optimizer)`` accepts the difference for one optimizer; its
state that is neither shaped like its shard nor a scalar then differs between ranks, and
checkpoints that merge ranks refuse it (``_sharding.state_layout``, one rule for the step and
every checkpoint).
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, Set

import torch
import torch_xla.debug.metrics as xla_metrics

from .._sharding.layout import Dim0Layout
from .._sharding.state_layout import StateLayout, state_layout
from .._xla import reduced_gradients
from .._xla.private_api import graph_hash, graph_hlo, needs_computation
from .param_record import taken_name
from .shard_group import shard_group_of, shard_groups_of
from .unit_params import params_of

ACCELERATE_FSDP = "ACCELERATE_USE_FSDP"


def check_accelerate_setting() -> None:
    """When the first unit is built: warns if the user set ``ACCELERATE_USE_FSDP`` to
    anything but true (see [Note: telling accelerate the gradients are sharded])."""
    value = os.environ.get(ACCELERATE_FSDP)
    if value is not None and not _accelerate_told():
        warnings.warn(f"{ACCELERATE_FSDP}={value}: accelerate (and Hugging Face Trainer) will "
                      f"all-reduce the sharded gradients of this FSDP model, averaging different "
                      f"ranks' shards; its optimizer step will be refused")


# [Note: telling accelerate the gradients are sharded]
# Without ``ACCELERATE_USE_FSDP`` Hugging Face accelerate all-reduces every gradient on XLA,
# in its optimizer step and its ``clip_grad_norm_``, averaging different ranks' shards
# together; transformers' Trainer sets it only for non-XLA FSDP. accelerate reads it at each
# step, between the backward and the optimizer's step, so FSDP sets it when a backward of
# its own ends and takes it back after the step of an optimizer over that model's shards,
# once no device (one per rank; several on virtual devices) is between the two. Set for
# good, it also stopped the all-reduce of any model trained without FSDP later in the
# process (a plain data-parallel Trainer after an FSDP one), whose replicas then drifted
# apart silently. A value the user set is never changed, and ``check_step`` refuses the
# step it would corrupt.
_between_backward_and_step: Set[str] = set()   # devices
_declared = False                              # whether the variable's value is ours
_declaration = threading.Lock()


def declare_sharded_gradients(device: torch.device) -> None:
    """At the end of an FSDP backward on ``device`` (see [Note: telling accelerate the
    gradients are sharded])."""
    global _declared
    with _declaration:
        if ACCELERATE_FSDP in os.environ and not _declared:
            return
        _between_backward_and_step.add(str(device))
        os.environ[ACCELERATE_FSDP] = "true"
        _declared = True


def withdraw_declaration(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step post-hook (see [Note: telling accelerate the gradients are sharded])."""
    global _declared
    devices = {str(params_of(g).device) for g in shard_groups_of(optimizer)}
    with _declaration:
        _between_backward_and_step.difference_update(devices)
        if _declared and not _between_backward_and_step:
            os.environ.pop(ACCELERATE_FSDP, None)
            _declared = False


def _accelerate_told() -> bool:
    return os.environ.get(ACCELERATE_FSDP, "").lower() in ("1", "true")


def count_updates(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step post-hook."""
    for shard_group in shard_groups_of(optimizer):
        shard_group.mark_updated()


_audited: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_reaudited_after_loads: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
# the audit's findings by graph (``graph_hash``): they are positions among the graph's
# outputs, so a graph seen before, such as every virtual rank's identical first step in
# one process, is read once
_findings: Dict[bytes, List[reduced_gradients.Finding]] = {}
_FINDINGS_KEPT = 64
_PER_SHARD_ALLOWED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
# the shards and state before an optimizer's first step, for ``audit_update``
_before_update: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = \
    weakref.WeakKeyDictionary()
# optimizers whose update reads the whole tensor (module.class, under each name torch has
# given the class), and what they read
_FACTORED = "row and column means and the RMS of a tensor"
_WHOLE_TENSOR = {
    "torch.optim.Adafactor": _FACTORED, "torch.optim._adafactor.Adafactor": _FACTORED,
    "transformers.optimization.Adafactor": _FACTORED,
    "torch.optim.Muon": "the whole matrix, which it orthogonalizes",
    "torch.optim._muon.Muon": "the whole matrix, which it orthogonalizes",
    "torch.optim.lbfgs.LBFGS": "every parameter at once",
}


def allow_per_shard_statistics(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Lets ``optimizer``, whose update reads the whole tensor (Adafactor, Muon), step FSDP
    shards anyway, taking its statistics over each rank's slice: it then trains differently
    from the unsharded model (see [Note: optimizers that read the whole tensor]). Returns
    ``optimizer``."""
    _PER_SHARD_ALLOWED.add(optimizer)
    return optimizer


def _reads_whole_tensor(optimizer: torch.optim.Optimizer) -> str:
    for cls in type(optimizer).__mro__:
        what = _WHOLE_TENSOR.get(f"{cls.__module__}.{cls.__qualname__}")
        if what is not None:
            return what
    return ""


def check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook."""
    stale, unreduced, sharded = [], [], []
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            shard_group = shard_group_of(p)
            if shard_group is not None:
                sharded.append(p)
                if shard_group.accumulating():
                    unreduced.append(shard_group.names[0])
            elif taken_name(p) is not None:
                stale.append(taken_name(p))
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__} holds parameters that FSDP has replaced by shards "
            f"({', '.join(stale[:5])}{', ...' if len(stale) > 5 else ''}), or the empty "
            f"placeholders a module inside a unit lists in their place. Create the optimizer "
            f"after wrapping, from the wrapped model's parameters(); for a group of one "
            f"module's parameters (a learning rate of its own), wrap that module as a unit "
            f"and take its parameters(), or pick the shards by their original names from "
            f"model.get_original_names_and_sharded_parameters().")
    frozen = [p for p in sharded if shard_group_of(p).accumulating() and not p.requires_grad]
    if frozen:   # their accumulated gradients went when the next forward froze them
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): {shard_group_of(frozen[0]).names[0]} was "
            f"frozen (requires_grad=False) during a no_sync() accumulation and still is, so "
            f"the gradients accumulated before were not reduced; unsharded, the step would "
            f"apply them. Freeze parameters between optimizer steps, or unfreeze them "
            f"before the last backward.")
    if unreduced:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() after a backward under no_sync() and no "
            f"synchronised backward since: the gradients of {', '.join(unreduced[:5])}"
            f"{', ...' if len(unreduced) > 5 else ''} are not reduced across ranks yet. Run "
            f"the last micro-batch's backward outside no_sync().")
    if sharded and _called_from("optimizer_step", "torch_xla/core/xla_model.py"):
        raise RuntimeError(
            "xm.optimizer_step() averages gradients across all replicas, but FSDP gradients "
            "are already reduced and each rank holds a different shard. Call "
            "optimizer.step() instead.")
    if sharded and not _accelerate_told() and _called_from("step", "accelerate/optimizer.py"):
        raise RuntimeError(
            "accelerate has just all-reduced the FSDP gradients across replicas, averaging "
            "different ranks' shards together, because ACCELERATE_USE_FSDP is not set "
            "(Hugging Face Trainer sets it only for non-XLA FSDP, and xla_fsdp sets it when a "
            "unit is built unless it is set already). Set ACCELERATE_USE_FSDP=true.")
    if sharded and sharded[0].device.type == "xla":
        _warn_if_never_synced(optimizer, sharded)
    if sharded and optimizer not in _audited:
        _refuse_whole_tensor_update(optimizer, sharded)
        _refuse_full_parameter_state(optimizer, sharded)
        _refuse_decay_split_by_shard_shape(optimizer)
        _audit_reduced_gradients(optimizer, sharded)
        _refuse_unreduced_free_parameters(optimizer, sharded)
        _keep_for_the_update_audit(optimizer, sharded)
        if optimizer not in _reaudited_after_loads:   # a state loaded later: at the next step
            _reaudited_after_loads.add(optimizer)
            optimizer.register_load_state_dict_post_hook(_audited.discard)
        _audited.add(optimizer)


# [Note: a loop without torch_xla.sync()]
# On XLA a step runs when something ends it: ``torch_xla.sync()`` (``xm.mark_step()``, or
# ``MpDeviceLoader`` after each batch) computes every live tensor. A loop that only reads
# its loss (``loss.item()``) computes the loss alone: the parameters stay pending graphs, so
# each step's graph holds every step before it, grows, compiles anew and runs them all again
# (30 AdamW steps of a two-block model at N=2 on virtual devices: 4.3 s synced, 213 s not,
# and no error anywhere; torch_xla's FSDP is silent too). When an optimizer over shards
# steps three times with nothing synced between, the user is told once. What tells: the
# optimizer's own state from its last update (momentum, moments), still a pending graph at
# the next step unless a sync computed it (the shards themselves are rewritten by the
# backward's barriers every step, synced or not); an optimizer without tensor state falls
# back on torch_xla's count of its syncs (``MarkStep``, which ``metrics.clear_all()`` also
# resets). A loop that syncs every few steps on purpose gets the same single warning.
_UNSYNCED_STEPS_TOLD = 3
_syncs_seen: "weakref.WeakKeyDictionary[torch.optim.Optimizer, List[int]]" = \
    weakref.WeakKeyDictionary()


def _warn_if_never_synced(optimizer: torch.optim.Optimizer, sharded: List[torch.Tensor]
                          ) -> None:
    """See [Note: a loop without torch_xla.sync()]."""
    state = next((v for p in sharded for v in optimizer.state.get(p, {}).values()
                  if torch.is_tensor(v) and v.device.type == "xla" and v.dim() > 0), None)
    syncs = xla_metrics.counter_value("MarkStep") or 0
    seen = _syncs_seen.setdefault(optimizer, [-1, 0])   # the count at the last step, steps
    unsynced = needs_computation([state])[0] if state is not None else syncs == seen[0]
    seen[1] = seen[1] + 1 if unsynced else 0
    seen[0] = syncs
    if seen[1] == _UNSYNCED_STEPS_TOLD - 1:
        warnings.warn(
            f"{type(optimizer).__name__}.step() ran {_UNSYNCED_STEPS_TOLD} times without a "
            f"torch_xla.sync() (xm.mark_step()) between the steps: the parameters stay pending "
            f"graphs, so every step's graph holds all the steps before it, compiles anew and "
            f"runs them again. Call torch_xla.sync() after optimizer.step() (MpDeviceLoader "
            f"does it after each batch).", stacklevel=3)


def _refuse_full_parameter_state(optimizer: torch.optim.Optimizer,
                                 params: List[torch.Tensor]) -> None:
    """An optimizer state of another shape than the shard it is for: a full (unsharded)
    state dict, or one of another world size or layout, loaded with
    ``optimizer.load_state_dict`` (Lightning's full checkpoint holds one). torch accepts it
    and the update then fails deep in the optimizer, or trains a mismatch. An optimizer
    whose update is elementwise keeps every state in its shard's shape or as a scalar
    (``_sharding.state_layout``, the rule every checkpoint applies too; those that do not
    are refused at their first update, or allowed per shard). Refused before any update,
    naming the parameter and the loads that fit."""
    if optimizer in _PER_SHARD_ALLOWED:
        return
    for p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value) and \
                    state_layout(key, value.shape, p.shape) is StateLayout.PER_SHARD:
                whole = tuple(value.shape) in {tuple(s) for s in shard_group_of(p).layout.shapes}
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): the optimizer state {key!r} of "
                    f"{shard_group_of(p).names[0]} has "
                    + ("the whole parameter's shape " if whole else "shape ")
                    + f"{tuple(value.shape)}, not its shard's {tuple(p.shape)}: a state dict "
                    f"of the unsharded model, or of another world size or shard layout, was "
                    f"loaded with optimizer.load_state_dict. Load it with "
                    f"model.load_full_optim_state_dict(optimizer, state), or save and load "
                    f"with xla_fsdp.checkpoint, which reshard it. Refused before any update.")


def _refuse_whole_tensor_update(optimizer: torch.optim.Optimizer,
                                params: List[torch.Tensor]) -> None:
    """See [Note: optimizers that read the whole tensor]."""
    what = _reads_whole_tensor(optimizer)
    if not what or optimizer in _PER_SHARD_ALLOWED:
        return
    cut = [shard_group_of(p) for p in params]
    cut = [g for g in cut if not (isinstance(g.layout, Dim0Layout) and g.layout.world_size == 1)]
    if cut:
        name = type(optimizer).__name__
        raise RuntimeError(
            f"{name}.step(): {name}'s update reads {what}, but it steps FSDP shards, each a "
            f"slice of its parameters ({', '.join(g.names[0] for g in cut[:3])}"
            f"{', ...' if len(cut) > 3 else ''}), so it would train differently from the "
            f"unsharded model. Use an optimizer whose update is elementwise (AdamW, SGD, ...), "
            f"or accept per-shard statistics with "
            f"xla_fsdp.allow_per_shard_statistics(optimizer). Refused before any update.")


def _refuse_decay_split_by_shard_shape(optimizer: torch.optim.Optimizer) -> None:
    """Weight decay split by ``p.dim() >= 2`` (nanoGPT's and timm's recipe) sees a flat
    shard as one-dimensional: every matrix lands in the group without decay, silently. Its
    signature, refused at the first step: a decayed param group that holds no shard of a
    matrix while a group without decay holds a flat shard of one."""
    def of_matrix(p: torch.Tensor) -> bool:
        shard_group = shard_group_of(p)
        return p.dim() >= 2 or shard_group is not None and \
            any(len(shape) >= 2 for shape in shard_group.layout.shapes)
    undecayed = [shard_group_of(p).names[0] for g in optimizer.param_groups
                 if not g.get("weight_decay", 0) for p in g["params"]
                 if p.dim() == 1 and of_matrix(p)]
    decayed = [g for g in optimizer.param_groups if g.get("weight_decay", 0)]
    if undecayed and any(not any(of_matrix(p) for p in g["params"]) for g in decayed):
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): a param group with weight decay holds no "
            f"matrix, while the group without it holds flat shards of matrices "
            f"({', '.join(undecayed[:3])}{', ...' if len(undecayed) > 3 else ''}): a split by "
            f"p.dim() or p.ndim sees each flat shard as one-dimensional. Split by the "
            f"original shapes (each shard's _orig_size, or the names of "
            f"model.get_original_names_and_sharded_parameters()), or shard with "
            f"shard_param_on_dim_0=True, whose shards keep their dimensions. Refused before "
            f"any update.")


def _refuse_unreduced_free_parameters(optimizer: torch.optim.Optimizer,
                                      sharded: List[torch.Tensor]) -> None:
    """A parameter in no unit, stepped beside multi-rank shards (a learnable loss
    temperature, task weights): each rank's gradient comes from its own batch, and nothing
    reduces it unless the loop does, so its copies drift apart. Refused when its pending
    gradient has no all-reduce (what already ran cannot be read, and is let through)."""
    if not any(shard_group_of(p).layout.world_size > 1 for p in sharded):
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    free = _pending([p for p in params if shard_group_of(p) is None and p.grad is not None
                     and p.grad.device.type == "xla"])
    if not free:
        return
    reduced = reduced_gradients.all_reduced(graph_hlo([p.grad for p in free]), len(free))
    lone = [p for p, done in zip(free, reduced) if not done]
    if lone:
        p = lone[0]
        index = next(i for i, q in enumerate(params) if q is p)
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): parameter {index} (shape {tuple(p.shape)}) "
            f"is in no FSDP unit, so each rank's gradient of it comes from its own batch and "
            f"nothing reduces it: its copies would drift apart across ranks. Make it a "
            f"parameter of the wrapped model, or all-reduce its gradient (averaged over "
            f"ranks) before the step. Refused before any update.")


def _keep_for_the_update_audit(optimizer: torch.optim.Optimizer,
                               params: List[torch.Tensor]) -> None:
    """Before a step ``audit_update`` reads: what the multi-rank shards and their state hold
    now, as pending copies (nothing runs unless the update is refused and put back)."""
    if optimizer in _PER_SHARD_ALLOWED or torch.compiler.is_compiling():
        return
    kept = []
    for p in filter(_sliced_gradient, params):
        state = {k: v.detach().clone() if torch.is_tensor(v) else v
                 for k, v in optimizer.state.get(p, {}).items()}
        kept.append((p, p.detach().clone(), state, p in optimizer.state))
    if kept:
        _before_update[optimizer] = kept


def audit_update(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step post-hook, the first of them: see [Note: auditing an optimizer's
    update]. A refused update is put back before the error is raised."""
    kept = _before_update.pop(optimizer, None)
    if not kept:
        return
    updated = [p for (p, *_), waits in zip(kept, needs_computation([k[0] for k in kept]))
               if waits]
    if not updated:
        return
    findings = reduced_gradients.audit(graph_hlo(updated), updates=True)
    found = [f for f in findings if f.what == reduced_gradients.WHOLE_TENSOR]
    if not found:
        return
    with torch.no_grad():
        for p, value, state, had_state in kept:
            p.copy_(value)
            if had_state:
                optimizer.state[p] = state
            else:
                optimizer.state.pop(p, None)
    names = [shard_group_of(updated[f.output]).names[0] for f in found]
    name = type(optimizer).__name__
    raise RuntimeError(
        f"{name}.step(): {name}'s update of {', '.join(names[:3])}"
        f"{', ...' if len(names) > 3 else ''} reads more of a tensor than each element (a "
        f"norm, a mean over rows or columns, a matrix product: HLO instruction "
        f"{found[0].instruction} of the step), but each rank holds a slice, so it would "
        f"train differently from the unsharded model. Use an optimizer whose update is "
        f"elementwise (AdamW, SGD, Lion, ...), or accept per-shard statistics with "
        f"xla_fsdp.allow_per_shard_statistics(optimizer). The update was put back.")


def _sliced_gradient(p: torch.Tensor) -> bool:
    """Whether shard ``p`` has a gradient on the device that FSDP reduce-scattered into a
    slice: a world of one holds whole gradients (nothing done to them mixes slices), and a
    vocabulary table's gradient is computed by its lookups' own collectives (the audits
    would read its backward as part of what follows the reduction)."""
    shard_group = shard_group_of(p)
    return p.grad is not None and p.grad.device.type == "xla" \
        and shard_group.layout.world_size > 1 and not shard_group.vocab_table


def _pending(params: List[torch.Tensor]) -> List[torch.Tensor]:
    """Those of ``params`` whose gradient is a pending graph, not computed yet (what already
    ran cannot be read)."""
    if not params:
        return []
    return [p for p, waits in zip(params, needs_computation([p.grad for p in params])) if waits]


def _audit_reduced_gradients(optimizer: torch.optim.Optimizer,
                             params: List[torch.Tensor]) -> None:
    """See [Note: auditing reduced gradients]: once per optimizer, on the graph of the
    gradients it is about to apply, before anything of it runs."""
    audited = _pending(list(filter(_sliced_gradient, params)))
    if not audited:
        return
    grads = [p.grad for p in audited]
    key = graph_hash(grads)
    findings = _findings.get(key)
    if findings is None:
        findings = reduced_gradients.audit(graph_hlo(grads))
        if len(_findings) >= _FINDINGS_KEPT:
            _findings.clear()
        _findings[key] = findings
    if not findings:
        return
    names = [shard_group_of(audited[f.output]).names[0] for f in findings]
    first = findings[0]
    raise RuntimeError(
        f"{type(optimizer).__name__}.step(): the FSDP gradients of {', '.join(names[:5])}"
        f"{', ...' if len(names) > 5 else ''} were {first.what} after FSDP reduce-scattered "
        f"them (HLO instruction {first.instruction} of the pending step), so each rank would "
        f"apply a different, wrong update. The usual causes: "
        + ("torch.nn.utils.clip_grad_norm_ (or a library's clipping) over the shards instead "
           "of the FSDP model's clip_grad_norm_(), which takes the norm over all ranks"
           if first.what == reduced_gradients.LOCAL_SCALE else
           "a data-parallel gradient all-reduce (xm.reduce_gradients, xm.optimizer_step, "
           "accelerate without ACCELERATE_USE_FSDP) on a model whose FSDP units already "
           "reduce their gradients") + ". The step is refused before any update.")


# [Note: clipping and averaging refused where they are called]
# The step's audit (see [Note: auditing reduced gradients]) reads an optimizer's first
# pending step only: clipping that starts at a later step, or a ``torch_xla.sync()`` between
# the clipping and the step (which executes what the audit would read), went through, and
# each rank clipped its slice by its own norm (0.45 relative off the unsharded model after
# three steps). The calls ported data-parallel code makes are refused where they are
# called instead, whenever they are given multi-rank shards: torch's ``clip_grad_norm_`` and
# its two halves, ``get_total_norm`` then ``clip_grads_with_norm_`` (public since torch 2.6;
# the second is given the parameters, so it is the one refused), as ``model.clip_grad_norm_``
# takes the norm over every rank; and ``xm.reduce_gradients`` (FSDP's gradients are reduced
# already). Code that bound the functions before the first unit was built is still met by
# the audit.
def refuse_local_clipping_and_averaging() -> None:
    """Wraps torch's ``clip_grad_norm_`` and ``clip_grads_with_norm_`` and torch_xla's
    ``reduce_gradients`` once per process (see [Note: clipping and averaging refused where
    they are called])."""
    import torch.nn.utils as utils
    import torch_xla.core.xla_model as xm
    if getattr(utils.clip_grad_norm_, "refuses_shards", False):
        return

    def refusing(clip: Callable[..., Any], name: str) -> Callable[..., Any]:
        def refuses_shards(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            shards = _multi_rank_shards(params)
            if shards:
                raise RuntimeError(
                    f"torch.nn.utils.{name} over FSDP shards ({', '.join(shards[:3])}"
                    f"{', ...' if len(shards) > 3 else ''}) would clip each rank's slice by the "
                    f"norm of that slice alone; call the root FSDP model's "
                    f"clip_grad_norm_(max_norm, norm_type), which takes the norm over every rank")
            return clip(params, *args, **kwargs)
        refuses_shards.refuses_shards = True  # type: ignore[attr-defined]
        return refuses_shards

    reduce = xm.reduce_gradients

    def reduce_gradients(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        params = [p for param_group in optimizer.param_groups for p in param_group["params"]]
        if _multi_rank_shards(params):
            raise RuntimeError(
                "xm.reduce_gradients() (or xm.optimizer_step(), which calls it) averages "
                "gradients across all replicas, but FSDP gradients are already reduced and "
                "each rank holds a different shard. Call optimizer.step() instead.")
        return reduce(optimizer, *args, **kwargs)

    for name in ("clip_grad_norm_", "clip_grads_with_norm_"):
        if hasattr(utils, name):   # clip_grads_with_norm_: torch 2.6 and later
            wrapped = refusing(getattr(utils, name), name)
            setattr(utils, name, wrapped)
            setattr(utils.clip_grad, name, wrapped)
    xm.reduce_gradients = reduce_gradients


def _multi_rank_shards(params: List[torch.Tensor]) -> List[str]:
    """The names of the shards among ``params`` that hold a slice each rank has its own of."""
    shard_groups = [shard_group_of(p) for p in params]
    return [g.names[0] for g in shard_groups if g is not None and g.layout.world_size > 1]


def _called_from(function: str, file_suffix: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == function and code.co_filename.endswith(file_suffix):
            return True
        frame = frame.f_back
    return False
