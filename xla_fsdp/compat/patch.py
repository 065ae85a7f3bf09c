"""``patch_torch_xla()``: torch_xla's FSDP package resolves to xla_fsdp.

For code that imports ``torch_xla.distributed.fsdp`` itself: Hugging Face Trainer, Lightning
Fabric, scripts written from torch_xla's documentation. After the call, those imports (and
``python -m torch_xla.distributed.fsdp.consolidate_sharded_ckpts`` run in this process)
get the modules of ``xla_fsdp.compat.torch_xla_fsdp``. Processes that ``xla_fsdp.launch`` starts
are patched too, before they unpickle the launched function.

[Note: no mixing] Units of torch_xla's FSDP and ours cannot share a model: each gathers,
frees and reduces its own way, and a checkpoint would mix two metadata formats. So the call
refuses when torch_xla's FSDP has already wrapped a module, or when a module imported its
classes already (that module would keep using them).
"""
from __future__ import annotations

import gc
import os
import sys
from typing import List

from .._xla.hardware import torch_xla_device_type_quietly

ENV = "XLA_FSDP_PATCH_TORCH_XLA"  # set by patch_torch_xla; launch's children patch too
_PACKAGE = "torch_xla.distributed.fsdp"
# Left for the import system to find in the compat package's __path__ under torch_xla's
# name, as ``python -m``/runpy require; it defines no classes, so a second copy is harmless.
_SCRIPT = "consolidate_sharded_ckpts"


def is_patched() -> bool:
    module = sys.modules.get(_PACKAGE)
    return module is not None and module.__name__ == "xla_fsdp.compat.torch_xla_fsdp"


def patch_torch_xla() -> None:
    """Makes ``torch_xla.distributed.fsdp`` (and its submodules) xla_fsdp's, in this process
    and in the processes ``launch`` starts from it. Idempotent.

    Call it before anything imports torch_xla's FSDP, e.g. at the top of the training
    script, before building a Trainer. Raises RuntimeError if torch_xla's own FSDP has
    already wrapped a module or been imported by name into another module.

    Hugging Face accelerate is told that FSDP is in use when the first unit is built (see
    ``_unit.optimizer_guard.declare_sharded_gradients``), not here: a process that patches
    but trains without FSDP still gets accelerate's gradient all-reduce.

    On transformers >= 5, Trainer's XLA FSDP path gets back the line it lost (see
    [Note: Trainer's wrapped model on transformers 5] in ``compat/hf_trainer.py``), when
    ``transformers.trainer`` is imported or at once if it is."""
    if is_patched():
        return
    torch_xla_device_type_quietly()   # torch_xla's import, without its CPU fallback warning
    _refuse_if_mixed()
    from . import torch_xla_fsdp
    from .torch_xla_fsdp import (consolidate_sharded_ckpts, state_dict_utils, utils, wrap,
                                 xla_flatten_params_wrapper, xla_fully_sharded_data_parallel)
    sys.modules[_PACKAGE] = torch_xla_fsdp
    for module in (xla_fully_sharded_data_parallel, wrap, utils, state_dict_utils,
                   consolidate_sharded_ckpts, xla_flatten_params_wrapper):
        name = module.__name__.rpartition(".")[2]
        setattr(torch_xla_fsdp, name, module)
        if name != _SCRIPT:
            # one module object under both names, so that each class exists once
            sys.modules[f"{_PACKAGE}.{name}"] = module
    import torch_xla.distributed
    torch_xla.distributed.fsdp = torch_xla_fsdp
    from .hf_trainer import install_when_imported
    install_when_imported()   # Trainer's XLA FSDP path on transformers 5
    os.environ[ENV] = "1"


def patch_if_requested() -> None:
    """In a process started by ``launch``: patch when the launching process had."""
    if os.environ.get(ENV) == "1":
        patch_torch_xla()


def _refuse_if_mixed() -> None:
    real = sys.modules.get(f"{_PACKAGE}.xla_fully_sharded_data_parallel")
    if real is None:
        return
    from .._xla.private_api import children
    cls = real.XlaFullyShardedDataParallel
    # type(), not isinstance: some objects in the heap warn when asked for __class__
    wrapped = [type(getattr(o.module, "module", o.module)).__name__ for o in gc.get_objects()
               if issubclass(type(o), cls) and "_fsdp_wrapped_module" in children(o)]
    if wrapped:
        raise RuntimeError(
            f"patch_torch_xla(): torch_xla's own FSDP has already wrapped {wrapped[:5]}; units "
            f"of the two implementations cannot share a model or a checkpoint. Call "
            f"patch_torch_xla() before any module is wrapped (at the top of the script).")
    holders = _modules_holding(cls)
    if holders:
        raise RuntimeError(
            f"patch_torch_xla(): {', '.join(holders[:5])} imported torch_xla's "
            f"XlaFullyShardedDataParallel before the patch and would keep using it; call "
            f"patch_torch_xla() before importing them.")


def _modules_holding(cls: type) -> List[str]:
    out, seen = [], set()
    for name, module in list(sys.modules.items()):
        if module is None or id(module) in seen or name.startswith(("torch_xla.", "xla_fsdp.")):
            continue
        seen.add(id(module))  # __main__ is also __mp_main__ under multiprocessing
        if any(value is cls for value in list(vars(module).values())):
            out.append(name)
    return out
