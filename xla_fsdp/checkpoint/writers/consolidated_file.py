"""Writing a consolidated checkpoint: the unwrapped model's state dict (and optimizer state)
read one tensor at a time (``UnwrappedState``), streamed to a ``.pth`` or ``.safetensors``
file, and verified by ``formats.verify_written``."""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch

from ..formats.consolidated import OPTIMIZER_NAMES, optimizer_companion
from ..files import (SafetensorsWriter, TorchFileWriter, atomic_path, atomic_paths,
                     remove_if_there)
from ..formats.keys import MODEL, OPTIMIZER
from ..unwrapped_state import UnwrappedState


def write_consolidated(state: UnwrappedState, path: str, fmt: str,
                       progress: Callable[[int], None]) -> List[str]:
    """Writes the consolidated checkpoint, with the optimizer when ``state`` has it; returns
    the paths written."""
    if fmt == "safetensors":
        specs = state.specs()
        tied = {source for _, source in state.aliases}
        # the optimizer file holds ``extra`` too: written for either
        companion = state.optimizer is not None or bool(state.extra)
        written = [path] + ([optimizer_companion(path)] if companion else [])
        # the pair is replaced together: neither file goes in before the other is on disk
        with atomic_paths(written) as staged:
            with staged[path].writing() as tmp:
                writer = SafetensorsWriter(tmp, specs, {"format": "pt"})
                held: Dict[str, torch.Tensor] = {}
                for name, tensor in state.entries():
                    writer.add(name, tensor)
                    progress(tensor.numel())
                    if name in tied:
                        held[name] = tensor  # a tied weight is written again under its alias
                for alias, source in state.aliases:
                    writer.add(alias, held[source])
                writer.finish()
            if companion:
                with staged[written[1]].writing() as tmp:
                    _finish(TorchFileWriter(tmp), {}, state)
            else:  # an earlier save's optimizer file would be loaded with these weights
                remove_if_there(optimizer_companion(path))
        return written
    with atomic_path(path) as tmp:
        writer = TorchFileWriter(tmp)
        model: Dict[str, Any] = {}
        for name, tensor in state.entries():
            model[name] = writer.add(tensor)
            progress(tensor.numel())
        # one record under both names: stays tied on load
        _finish(writer, {MODEL: state.with_aliases(model)}, state)
    return [path]


def _finish(writer: TorchFileWriter, tree: Dict[str, Any], state: UnwrappedState) -> None:
    """Finishes ``writer`` with ``tree``, the optimizer's state when ``state`` has it (by
    index, with its parameters' names) and ``state``'s extra."""
    if state.optimizer is not None:
        tree[OPTIMIZER], tree[OPTIMIZER_NAMES] = state.optimizer.as_indexed_state_dict(writer.add)
    writer.finish(dict(tree, **state.extra))
