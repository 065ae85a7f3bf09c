"""Hugging Face Trainer's XLA FSDP path, where it goes wrong under any XLA FSDP, fixed by
``patch_torch_xla()``: the default fused optimizer, weight decay inside units, the
causal-LM check of the label smoother, a resume at another device count, and on
transformers 5 the wrapped model it stopped keeping (each a Note below).

[Note: Trainer's wrapped model on transformers 5]
transformers 4's ``Trainer._wrap_model`` wrapped the model for XLA FSDP and set
``self.model`` to the wrapped model (``self.model = model = FSDP(...)``). The training
loop then took ``model is self.model`` as "accelerate may prepare this model", handed it
to ``accelerator.prepare`` and created the optimizer from it. transformers 5 moved the
wrapping to ``integrations/tpu.py`` (``wrap_model_xla_fsdp``), which returns the wrapped
model and leaves ``self.model`` alone, so ``Trainer._prepare_for_training`` takes the
branch for models wrapped by something accelerate does not handle:

* ``self.optimizer = self.accelerator.prepare(self.optimizer)``: the optimizer, whose
  creation is delayed for XLA FSDP and done only in the other branch, is None, and
  ``create_scheduler`` fails on ``None.param_groups`` before the first step;
* the model is never registered with accelerate, so ``Accelerator.clip_grad_norm_``
  finds no model whose parameters match and falls back to torch's ``clip_grad_norm_``
  over the parameters it is given: each rank clips its own shards by their own norm, and
  training goes silently wrong (see [Note: auditing reduced gradients], which now refuses
  it at the first step).

Both are the same lost line, and it is restored where it was lost: after
``Trainer._wrap_model`` has wrapped a model for XLA FSDP (v1) in training,
``self.model`` is the wrapped model, and transformers' own code takes the branch it takes
for every model accelerate prepares (prepare the model, create the optimizer from it,
prepare the optimizer), as transformers 4 did. FSDPv2 (SPMD) is left alone: it is not
ours to replace. Installed by ``patch_torch_xla()`` on transformers >= 5 only, when
``transformers.trainer`` is imported (at once if it already is), without importing
transformers ourselves.
"""
from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import threading
import warnings
from typing import Any, Callable, Dict, List

import torch

from .._xla.private_api import parameters_replaced, wrap_trainer_method

_MODULE = "transformers.trainer"
_lock = threading.Lock()
_done = False


def install_when_imported() -> None:
    """Installs the fix now if ``transformers.trainer`` is imported, else when it is."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        _install(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_MODULE, _install))


def _install(module: Any) -> None:
    global _done
    with _lock:
        if _done:
            return
        _done = True
        trainer = module.Trainer
        trainer.get_optimizer_cls_and_kwargs = staticmethod(
            _unfused_on_xla(trainer.get_optimizer_cls_and_kwargs))
        trainer.get_decay_parameter_names = _decay_by_original_names(
            trainer.get_decay_parameter_names)
        trainer.compute_loss = _names_the_wrapped_model(trainer.compute_loss)
        wrap_trainer_method(trainer, "_load_optimizer_and_scheduler", functools.partial(
            _loads_at_any_world_size, module=module))
        version = getattr(sys.modules.get("transformers"), "__version__", "0")
        if int(version.split(".")[0]) >= 5:
            wrap_trainer_method(trainer, "_wrap_model", _keeps_wrapped_model)
        wrap_trainer_method(trainer, "_wrap_model", _wraps_once)


_FUSED = "adamw_torch_fused"


def _unfused_on_xla(get_optimizer: Callable) -> Callable:
    """[Note: Trainer's default optimizer on XLA] On torch >= 2.8, transformers makes
    ``adamw_torch_fused`` the default ``optim``, and torch's fused AdamW refuses XLA tensors
    at its first step ("fused=True requires all the params to be floating point Tensors of
    supported devices"), so Trainer fails on any XLA run that does not name an optimizer.
    Under ``patch_torch_xla()`` that choice becomes ``adamw_torch`` (the same update, not
    fused), with a warning the first time; an XLA run could not have used the fused one
    whether it was asked for or defaulted to."""
    warned = []

    @functools.wraps(get_optimizer)
    def get_optimizer_cls_and_kwargs(args, model=None):
        optim = getattr(args, "optim", None)
        if optim == _FUSED and _on_xla():   # OptimizerNames is a str enum
            args.optim = type(optim)("adamw_torch")
            if not warned:
                warned.append(True)
                warnings.warn("xla_fsdp: Trainer's optim 'adamw_torch_fused' (the default on "
                              "torch >= 2.8) does not run on XLA devices; using "
                              "'adamw_torch', the same AdamW unfused", stacklevel=2)
        return get_optimizer(args, model)
    return get_optimizer_cls_and_kwargs


def _on_xla() -> bool:
    from transformers.utils import is_torch_xla_available   # Trainer's own test for XLA
    return is_torch_xla_available()


def _keeps_wrapped_model(wrap_model: Callable) -> Callable:
    @functools.wraps(wrap_model)
    def keeps_wrapped_model(self, model, training: bool = True, dataloader=None):
        wrapped = wrap_model(self, model, training, dataloader)
        if training and wrapped is not model and getattr(self, "is_fsdp_xla_v1_enabled", False):
            self.model = wrapped   # see [Note: Trainer's wrapped model on transformers 5]
        return wrapped
    keeps_wrapped_model.xla_fsdp_keeps_wrapped_model = True
    return keeps_wrapped_model


def _wraps_once(wrap_model: Callable) -> Callable:
    """[Note: a second train() under XLA FSDP] ``Trainer.train()`` called again (to train
    some more, or to resume after a run) hands ``_wrap_model`` the model it wrapped before:
    on transformers 4 the module inside the root (``model_wrapped`` was never updated), on
    5 the root. On 4 a second root was built around the first one's module; it held none of
    the shards the first root took, so clipping left them out of the norm and the saved
    model lacked them, silently. On 5 wrapping again was refused. Now the root already
    built is returned, and training goes on with it, as plain Trainer goes on with its
    model."""
    @functools.wraps(wrap_model)
    def wrap_model_once(self, model, training: bool = True, dataloader=None):
        from .._init.validate import unit_wrapping
        root = unit_wrapping(model) if getattr(self, "is_fsdp_xla_v1_enabled", False) else None
        if training and root is not None and root.unit_state.is_root:
            self.model = root
            return root
        return wrap_model(self, model, training, dataloader)
    return wrap_model_once


def _decay_by_original_names(get_decay_names: Callable) -> Callable:
    """[Note: Trainer's weight decay inside units] Trainer splits the optimizer's parameters
    into a decayed group and one without decay by ``get_decay_parameter_names(model)``: not
    a parameter of a LayerNorm module, nor one whose path says bias or norm. It applies that
    rule to the wrapped model, where a unit holds its shards under names of its own and the
    LayerNorm modules hold none, so GPT-2's ``ln_*`` and Llama's final ``norm`` were decayed,
    unlike the same Trainer on the plain model (torch_xla's FSDP does the same).

    Trainer's own rule now runs on the model as it was before wrapping: for the call, each
    original parameter (its placeholder) is registered again in the modules that held it and
    the units' shards are hidden; then each shard goes in the decayed group when the
    parameters it holds were decayed, named as the wrapped model names it. A flattened shard
    holding parameters of both kinds cannot be decayed like the plain model's with any
    ``weight_decay`` but 0, and is refused, naming them."""
    @functools.wraps(get_decay_names)
    def get_decay_parameter_names(self, model):
        from ..unit_module import UnitModule
        units = [m for m in model.modules() if isinstance(m, UnitModule)]
        if not units:
            return get_decay_names(self, model)
        with _unwrapped_parameters(units):
            decayed = set(get_decay_names(self, model))
            decayed_ids = {id(p) for n, p in model.named_parameters() if n in decayed}
        shard_decayed = {}
        for unit in units:
            for g in unit.shard_groups:
                kinds = {id(r.placeholder) in decayed_ids for r in g.records}
                if len(kinds) > 1 and getattr(self.args, "weight_decay", 0):
                    names = [(r.name, id(r.placeholder) in decayed_ids) for r in g.records]
                    raise ValueError(
                        f"xla_fsdp: the flattened shard {g.orig_name!r} of unit "
                        f"{type(unit.wrapped_module).__name__} holds parameters Trainer decays "
                        f"and parameters it does not ({[n for n, d in names if d][:3]} and "
                        f"{[n for n, d in names if not d][:3]}); weight_decay="
                        f"{self.args.weight_decay} cannot apply to part of one tensor. Wrap "
                        f"with flatten_parameters=False (fsdp_config's xla_fsdp_settings), or "
                        f"set weight_decay=0")
                shard_decayed[id(g.shard)] = True in kinds
        return [n for n, p in model.named_parameters()
                if shard_decayed.get(id(p), n in decayed)]
    return get_decay_parameter_names


def _names_the_wrapped_model(compute_loss: Callable) -> Callable:
    """[Note: Trainer's causal-LM check under FSDP] With ``label_smoothing_factor``, Trainer
    shifts the labels by one token only when ``accelerator.unwrap_model(model)._get_name()``
    names a causal LM. accelerate unwraps torch's wrappers, not torch_xla's FSDP nor ours,
    so under FSDP the name was the unit's and a causal LM was trained to predict each token
    from itself, from the first step. For the call, ``unwrap_model`` goes on through a root
    unit to the model it wraps, as it does through torch's FSDP."""
    @functools.wraps(compute_loss)
    def names_the_wrapped_model(self, model, *args, **kwargs):
        from ..unit_module import UnitModule
        accelerator = getattr(self, "accelerator", None)
        if accelerator is None or not isinstance(accelerator.unwrap_model(model), UnitModule):
            return compute_loss(self, model, *args, **kwargs)
        unwrap = accelerator.unwrap_model
        had_own = "unwrap_model" in vars(accelerator)

        def through_units(m, *a, **k):
            m = unwrap(m, *a, **k)
            while isinstance(m, UnitModule):
                m = unwrap(m.wrapped_module, *a, **k)
            return m
        accelerator.unwrap_model = through_units
        try:
            return compute_loss(self, model, *args, **kwargs)
        finally:
            if had_own:
                accelerator.unwrap_model = unwrap
            else:
                del accelerator.unwrap_model
    return names_the_wrapped_model


def _loads_at_any_world_size(load: Callable, module: Any) -> Callable:
    """[Note: Trainer's optimizer at another world size] Under XLA FSDP, Trainer saves each
    rank's optimizer state as ``rank{r}-of-{N}-optimizer.pt`` and, resuming, looks only for
    files of its own N: at another device count it loaded the weights (from the
    consolidated model) and started the optimizer and the learning-rate schedule again,
    without a word. Now the optimizer state is read from the N ranks' files into this run's
    shards, as ``load_sharded`` reads per-rank files at another world size
    (``sources.trainer_files``), and the schedule from ``scheduler.pt``, as Trainer reads
    it. So are files of this run's N saved from shards cut otherwise (another layout,
    flattening or units: Trainer's loader failed in torch, or the optimizer's step refused
    state of another shape). A checkpoint holding files of several world sizes, or a model
    Trainer did not wrap with ours, is refused on every rank, naming the files."""
    optimizer_file = module.OPTIMIZER_NAME

    @functools.wraps(load)
    def load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None or not getattr(self, "is_fsdp_xla_v1_enabled", False):
            return load(self, checkpoint)
        from ..checkpoint.coordination import exchange
        from ..checkpoint.sources.trainer_files import trainer_file, trainer_file_worlds
        from ..unit_module import UnitModule
        # the wrapped model is Trainer's model on transformers 4, and model_wrapped on 5
        model = next((m for m in (self.model_wrapped, self.model) if isinstance(m, UnitModule)),
                     None)
        world = self.args.world_size
        scheduler = os.path.join(checkpoint, module.SCHEDULER_NAME)
        own = trainer_file(checkpoint, self.args.process_index, world, optimizer_file)
        listed = os.listdir(checkpoint) if os.path.isdir(checkpoint) else []
        # every rank's view, so that all take the same way (the other one is collective)
        views = exchange("xla_fsdp.trainer_resume.files", (
            sorted(trainer_file_worlds(listed, optimizer_file)), os.path.isfile(scheduler),
            _shards_differ(own, model)))
        saved = sorted({n for counts, _, _ in views for n in counts})
        # Trainer loads neither without the schedule's file
        if not saved or not all(found for _, found, _ in views):
            return load(self, checkpoint)
        if world in saved:
            # Trainer's loader reads this rank's file index by index, right only when the
            # shards are cut as they were saved
            if not any(differ for _, _, differ in views):
                return load(self, checkpoint)
            saved = [world]
        if len(saved) > 1 or model is None:
            raise ValueError(
                f"xla_fsdp: {checkpoint} holds Trainer's optimizer state for "
                f"{' and '.join(map(str, saved))} rank(s) (rank*-of-{saved[0]}-"
                f"{optimizer_file})" + (", files of several runs" if len(saved) > 1 else
                                        ", and the model is not wrapped by xla_fsdp") +
                f"; this run has {world}. Resume on {saved[0]} devices, or remove those "
                f"files to resume the weights alone")
        _load_optimizer_from(checkpoint, saved[0], model, self.optimizer, module)
        self.lr_scheduler.load_state_dict(torch.load(scheduler, map_location="cpu",
                                                     weights_only=True))
    return load_optimizer_and_scheduler


def _shards_differ(path: str, model: Any) -> bool:
    """Whether this rank's optimizer file at ``path`` was saved from shards cut otherwise
    than ``model``'s (another layout, flattening or units): the wrapping its shard metadata
    describes differs (not its values: ``xm.save`` turns tuples into lists, and the update
    count moves)."""
    if model is None or not os.path.isfile(path):
        return False
    from ..checkpoint.files import CheckpointFile
    from ..checkpoint.formats.per_rank import SHARD_METADATA, wrapping_fingerprint
    with CheckpointFile(path) as f:
        saved = f.tree.get(SHARD_METADATA) if isinstance(f.tree, dict) else None
    return isinstance(saved, dict) and \
        wrapping_fingerprint(saved) != wrapping_fingerprint(model.get_shard_metadata())


def _load_optimizer_from(checkpoint: str, world: int, model: Any, optimizer: Any,
                         module: Any) -> None:
    from ..checkpoint.sources.trainer_files import open_trainer_files
    from ..checkpoint.staging import load_staged
    optimizer = getattr(optimizer, "optimizer", optimizer)   # accelerate's wrapper
    names = {id(p): n for n, p in model.named_parameters()}
    if any(id(p) not in names for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("xla_fsdp: Trainer's optimizer holds a parameter the wrapped model "
                         "does not, so its state cannot be matched to the saved shards")
    param_names = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    load_staged(lambda: open_trainer_files(checkpoint, world, module.WEIGHTS_NAME,
                                           module.OPTIMIZER_NAME, param_names,
                                           (model.rank, model.world_size)),
                model, optimizer, "xla_fsdp.trainer_resume", with_model=False)


def _unwrapped_parameters(units: List[Any]) -> Any:
    """The units' original parameters (their placeholders) registered in the modules that
    held them again, their shards not, for a block."""
    replacements: Dict[Any, Dict[str, Any]] = {}

    def registered(module: Any) -> Dict[str, Any]:
        if module not in replacements:
            replacements[module] = dict(module.named_parameters(recurse=False))
        return replacements[module]
    for unit in units:
        shards = {id(g.shard) for g in unit.shard_groups}
        own = registered(unit)
        for name in [n for n, p in own.items() if id(p) in shards]:
            del own[name]
        for g in unit.shard_groups:
            for record in g.records:
                for module, attr in record.owners:
                    registered(module)[attr] = record.placeholder
    return parameters_replaced(replacements)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once ``name`` has been executed by its own loader."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        spec = None
        for finder in list(sys.meta_path):   # the finder that would have found it
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            self.then(module)
        spec.loader.exec_module = exec_then_install
        return spec
