"""A DCP directory's ``.metadata`` read without running anything the file names.

torch's ``FileSystemReader.read_metadata`` reads ``.metadata`` with ``pickle.load``, so a
checkpoint from elsewhere runs whatever its pickle calls the moment it is opened, before any
check of ours. Every DCP directory we read (``load_dcp``, ``load_consolidated``, the
verification of ``consolidate_sharded_ckpts --format dcp``) reads its ``.metadata`` here.

Design decision: an allow-list of globals, as ``torch.load(weights_only=True)`` has for
tensors; a deny-list misses the next gadget. Admitted is what a ``.metadata`` written by
torch 2.x holds, read off real files (``dcp.save`` in one process, FSDP2's ``get_state_dict``
+ ``dcp.save``, torchtitan's recipe, our ``save_dcp``): DCP's metadata dataclasses (and the
``TensorProperties`` torch 2.0 and 2.1 pickled from the sharded tensor's module), its file
system writer's ``_StorageInfo``, the memory-format encoding, ``torch.Size``, dtypes and
layouts, ``OrderedDict``, and the path the writer was given. Anything else, a function, class
or module, raises ``CheckpointError`` naming the file and the global before the global is
looked up; persistent ids, which no ``.metadata`` holds, are refused too. DCP's classes
resolve to the very classes torch's reader would have made, so the rest of the load sees
what it always saw. Two kinds of name are answered by our own objects instead:

- ``torch.serialization._get_layout("torch.strided")``, how torch pickles a layout: a lookup
  among torch's layouts (``_layout_named``), so no function of torch's is called;
- ``pathlib.PosixPath`` / ``WindowsPath`` (``StorageMeta.checkpoint_id``, where the writer
  saved): read as ``PurePosixPath`` / ``PureWindowsPath``, a name from another machine that
  nothing here opens; a checkpoint saved on Windows loads on Linux.

[Note: building only instances]
Pickle's BUILD sets the state of the object beneath it on the stack, and a crafted file can
put an admitted class there instead of an instance: the attributes it sets then land on
torch's class for the rest of the process. Nothing admitted runs code, but a class changed
that way corrupts quietly: ``Metadata.__getstate__`` set to ``OrderedDict`` makes every later
save in the process write an empty ``.metadata``. The C unpickler has no hook on BUILD; the
Python one (``pickle._Unpickler``) dispatches each opcode through a table, so
``_RestrictedUnpickler`` refuses a BUILD whose target is not an instance of an admitted class
(an enum's members are shared, so never). It is slower, two to two and a half times: a 20 MB
``.metadata`` (128,000 chunks) took 6 s instead of 2.7 s here, once per rank per load; a
typical one takes milliseconds.
"""
from __future__ import annotations

import enum
import pathlib
import pickle
from collections import OrderedDict
from typing import Any, Dict, FrozenSet, Tuple

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ...files import CheckpointError

METADATA_FILE = ".metadata"  # the name DCP gives it in every checkpoint directory

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# torch 2.0 and 2.1 pickled TensorProperties from the sharded tensor's module.
_LEGACY_PROPERTIES = "torch.distributed._shard.sharded_tensor.metadata"

# Resolved as pickle resolves them: by importing the module and reading the name.
_CLASSES: FrozenSet[Tuple[str, str]] = frozenset(
    [(_DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo")]
    + [(_LEGACY_PROPERTIES, "TensorProperties"), (_LEGACY_PROPERTIES, "MEM_FORMAT_ENCODING")])

_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


def read_metadata_file(path: str) -> Metadata:
    """The ``Metadata`` in the ``.metadata`` file at ``path``; ``CheckpointError`` naming the
    file if it holds anything but DCP's metadata classes, or cannot be read."""
    try:
        with open(path, "rb") as f:
            metadata = _RestrictedUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or garbled file: pickle's many error types
        raise CheckpointError(f"{path} cannot be read: {type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata) or not isinstance(
            metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata "
                              f"with its entries and storage")
    return metadata


def _layout_named(name: Any) -> torch.layout:
    """The layout torch pickles as ``_get_layout(name)``, e.g. ``"torch.strided"``."""
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise ValueError(f"no torch layout is named {name!r}")  # read_metadata_file names the file


_PATHS = {"PosixPath": pathlib.PurePosixPath, "PurePosixPath": pathlib.PurePosixPath,
          "WindowsPath": pathlib.PureWindowsPath, "PureWindowsPath": pathlib.PureWindowsPath}
# the other names admitted, each answered by an object of ours or torch's (see the module's
# docstring); Python 3.13 defines the path classes in pathlib._local, and its pickles may
# say so
_ANSWERED = {("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): _layout_named,
             ("collections", "OrderedDict"): OrderedDict,
             **{(module, name): path for module in ("pathlib", "pathlib._local")
                for name, path in _PATHS.items()}}


class _RestrictedUnpickler(pickle._Unpickler):
    """Pickle's Python unpickler, resolving only the admitted globals and building only
    instances of admitted classes (see [Note: building only instances])."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self._where = where
        self._buildable: Dict[type, None] = {OrderedDict: None}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            found = super().find_class(module, name)
            if isinstance(found, type) and not issubclass(found, enum.Enum):
                self._buildable[found] = None  # an enum's members are shared: never built
            return found
        if (module, name) in _ANSWERED:
            return _ANSWERED[module, name]
        # not getattr: torch's __getattr__ imports modules
        value = vars(torch).get(name) if module == "torch" else None
        if isinstance(value, _TORCH_VALUES):
            return value
        raise CheckpointError(f"{self._where}: refuses to load {module}.{name}: a DCP .metadata "
                              f"holds only DCP's metadata classes")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self._where}: refuses a persistent id ({pid!r:.80}): a DCP "
                              f".metadata holds only DCP's metadata classes")

    def _load_build(self) -> None:
        target = self.stack[-2]  # beneath the state BUILD pops
        if type(target) not in self._buildable:
            raise CheckpointError(f"{self._where}: refuses to set the state of "
                                  f"{_describe(target)}: a DCP .metadata sets it only on "
                                  f"instances of DCP's metadata classes")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


def _describe(value: Any) -> str:
    if isinstance(value, type):
        return f"the class {value.__module__}.{value.__qualname__}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"
