"""Opening a consolidated checkpoint as a loader's source, whichever format holds it: a DCP
directory, a Hugging Face directory (``model.safetensors`` or sharded with
``model.safetensors.index.json``), a ``.safetensors`` file (with the ``.optimizer.pth``
``consolidate_sharded_ckpts`` writes beside it), or a ``torch.save`` file (ours, with
``model``, ``optimizer`` and ``optimizer_param_names``, or a bare state dict). Files are
opened lazily (``files``): nothing but headers is read until the loader asks for runs.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, Optional, Tuple, TypeVar, Union

from .dcp_files import DcpSource
from ..formats.dcp.metadata_file import METADATA_FILE
from ..staging import Source
from ..files import CheckpointError, CheckpointFile, SafetensorsFile
from ..formats.consolidated import HF_INDEX, HF_WEIGHTS, OPTIMIZER_NAMES, optimizer_companion
from ..live_model import is_extra_state_key
from ..formats.keys import EXTRA, MODEL, OPTIMIZER
from .entries import EntrySource, is_tensor, model_entries, optimizer_entries

_File = TypeVar("_File", bound=Union[CheckpointFile, SafetensorsFile])


def open_consolidated(path: str, safetensors: bool = False,
                      crc_share: Optional[Tuple[int, int]] = (0, 1),
                      optimizer_wanted: bool = False) -> Source:
    """The checkpoint at ``path`` as a source; ``CheckpointError`` naming the file at fault
    when it is none of the formats above, incomplete, or a ``torch.save`` file (``.pth``,
    a safetensors file's optimizer companion) with a record failing its CRC-32, or a
    safetensors file of ours with a tensor failing its CRC-32 (see [Note: checksums in a
    safetensors header] in ``files.writer``).
    ``crc_share`` (i, n): this caller checks every n-th record from the i-th, so that n
    ranks opening the file together read each once; None when the caller checked them.
    ``safetensors``: a file is one whatever its name ends with (its writer says so).
    ``optimizer_wanted``: a safetensors file whose optimizer companion is missing is refused,
    naming the companion (a file copied without it)."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, METADATA_FILE)):
            return DcpSource(path)
        if os.path.exists(os.path.join(path, HF_INDEX)):
            return _hf_sharded(path, crc_share)
        if os.path.exists(os.path.join(path, HF_WEIGHTS)):
            return _safetensors(os.path.join(path, HF_WEIGHTS), optimizer_file=False,
                                crc_share=crc_share)
        raise CheckpointError(f"{path}: neither a DCP checkpoint ({METADATA_FILE}) nor a "
                              f"Hugging Face directory ({HF_INDEX} or {HF_WEIGHTS})")
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    if safetensors or path.endswith(".safetensors"):
        if optimizer_wanted and not os.path.exists(optimizer_companion(path)):
            raise CheckpointError(f"{path} holds no optimizer state: the file that would hold "
                                  f"it, {optimizer_companion(path)}, is missing (load the "
                                  f"model alone with optimizer=None)")
        return _safetensors(path, optimizer_file=True, crc_share=crc_share)
    return _torch_file(path, crc_share)


def _hf_sharded(directory: str, crc_share: Optional[Tuple[int, int]]) -> EntrySource:
    index_path = os.path.join(directory, HF_INDEX)
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index_path}: not a safetensors index ({exc})") from None
    files: Dict[str, SafetensorsFile] = {}
    with contextlib.ExitStack() as to_close:
        for name in sorted(set(weight_map.values())):
            shard = os.path.join(directory, name)
            if not os.path.exists(shard):
                raise CheckpointError(f"{index_path} names {name}, which is missing from "
                                      f"{directory}")
            files[name] = _opened(to_close, SafetensorsFile(shard), crc_share)
        state = {}
        for key, name in weight_map.items():
            if key not in files[name].tensors:
                raise CheckpointError(f"{index_path} puts {key!r} in {name}, which does not "
                                      f"hold it")
            state[key] = files[name].tensors[key]
        return EntrySource(directory, *model_entries(state), [to_close.pop_all().close])


def _safetensors(path: str, optimizer_file: bool,
                 crc_share: Optional[Tuple[int, int]]) -> EntrySource:
    companion = optimizer_companion(path)
    with contextlib.ExitStack() as to_close:
        weights = _opened(to_close, SafetensorsFile(path), crc_share)
        tensors, objects = model_entries(weights.tensors)
        if optimizer_file and os.path.exists(companion):
            file = _opened(to_close, CheckpointFile(companion), crc_share)
            _add_optimizer(file.tree, companion, tensors, objects)
        return EntrySource(path, tensors, objects, [to_close.pop_all().close])


def _opened(to_close: contextlib.ExitStack, file: _File, crc_share: Optional[Tuple[int, int]]
            ) -> _File:
    """``file``, closed by ``to_close``, its records' CRC-32s checked first (unless the caller
    checked them: ``crc_share`` None)."""
    to_close.callback(file.close)
    if crc_share is not None:
        file.verify(crc_share)
    return file


def _torch_file(path: str, crc_share: Optional[Tuple[int, int]]) -> EntrySource:
    with contextlib.ExitStack() as to_close:
        tree = _opened(to_close, CheckpointFile(path), crc_share).tree
        if isinstance(tree, dict) and isinstance(tree.get(MODEL), dict):
            state = tree[MODEL]
        elif isinstance(tree, dict) and tree and all(
                isinstance(k, str) and (is_tensor(v) or is_extra_state_key(k))
                for k, v in tree.items()):
            state = tree  # torch.save(model.state_dict()), modules' extra state of any kind
        else:
            raise CheckpointError(f"{path}: holds neither a 'model' state dict nor a state dict")
        tensors, objects = model_entries(state)
        _add_optimizer(tree, path, tensors, objects)
        return EntrySource(path, tensors, objects, [to_close.pop_all().close])


def _add_optimizer(tree: Any, where: str, tensors: Dict[str, Any],
                   objects: Dict[str, Any]) -> None:
    """The optimizer state and ``extra`` a consolidated file holds, if any."""
    if not isinstance(tree, dict):
        return
    if OPTIMIZER in tree:
        more_tensors, more_objects = optimizer_entries(tree[OPTIMIZER], where,
                                                       tree.get(OPTIMIZER_NAMES))
        tensors.update(more_tensors)
        objects.update(more_objects)
    if EXTRA in tree:
        objects[EXTRA] = tree[EXTRA]
