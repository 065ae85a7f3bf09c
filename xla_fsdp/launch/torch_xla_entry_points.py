"""torch_xla's own launchers, ``xmp.spawn`` and ``torch_xla.launch``, run on this package's
launcher when there is no accelerator: what ``python -m xla_fsdp.launch script.py`` installs
before it runs a script written for torch_xla (Hugging Face's ``xla_spawn.py``, torch_xla's
examples), unchanged.

[Note: routing torch_xla's launchers]
On a TPU or Trainium host the two functions are left as they are: torch_xla's runner is
the launcher there. Without one, torch_xla 2.9 would start a process per CPU device, whose
collectives abort; ``launch`` runs the same function on N virtual devices in one process
instead. N is the ``nprocs`` the script asked for, else ``XLA_FSDP_NUM_DEVICES`` or 4, so a
script that sizes its data by the world size sees the world it asked for. ``xmp.spawn``'s
``fn(index, *args)`` is ``launch``'s own calling convention; ``torch_xla.launch`` calls
``fn(*args)``, so the rank is dropped for it.

[Note: a spawned child patches before it imports the script]
A process started with the spawn method imports the launching script again (as
``__mp_main__``) before it runs anything it was sent, so a script that imports torch_xla's
FSDP at its top would bind torch_xla's classes in every child, ours only in the parent.
``patch_spawned_children`` adds to what the parent sends first (the preparation data) an
object whose unpickling patches the child: it runs before the script's import, in
children of torch_xla's runner and of ours alike.
"""
from __future__ import annotations

import functools
import multiprocessing.spawn
from typing import Any, Callable, Optional, Tuple

from ..compat.patch import patch_if_requested
from .runner import accelerator_type, launch


def route_torch_xla_launchers() -> bool:
    """Points ``xmp.spawn`` and ``torch_xla.launch`` at ``launch`` when there is no
    accelerator, and returns whether it did (see [Note: routing torch_xla's launchers])."""
    if accelerator_type() is not None:
        return False
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp
    xmp.spawn = _spawn
    torch_xla.launch = _torch_xla_launch
    return True


def patch_spawned_children() -> None:
    """Every process this one spawns patches torch_xla's FSDP before it imports the
    launching script (see [Note: a spawned child patches before it imports the script])."""
    prepare = multiprocessing.spawn.get_preparation_data
    if getattr(prepare, "patches_children", False):
        return

    def with_patch(name: str) -> dict:
        return dict(prepare(name), xla_fsdp_patch=_PatchOnUnpickle())
    with_patch.patches_children = True
    multiprocessing.spawn.get_preparation_data = with_patch


class _PatchOnUnpickle:
    def __reduce__(self):
        return (patch_if_requested, ())


def _spawn(fn: Callable[..., Any], args: Tuple = (), nprocs: Optional[int] = None,
           join: bool = True, daemon: bool = False, start_method: str = "spawn") -> None:
    if not join:
        raise ValueError("xmp.spawn(join=False) is not supported on virtual devices: the "
                         "launcher returns when every rank has")
    launch(fn, tuple(args), num_devices=nprocs)


def _torch_xla_launch(fn: Callable[..., Any], args: Tuple = (), start_method: str = "spawn",
                      debug_single_process: bool = False) -> None:
    launch(functools.partial(_without_rank, fn), tuple(args),
           num_devices=1 if debug_single_process else None)


def _without_rank(fn: Callable[..., Any], rank: int, *args: Any) -> Any:
    return fn(*args)
