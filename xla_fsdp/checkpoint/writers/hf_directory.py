"""The consolidated model as a Hugging Face directory (``--format hf``): what
``save_pretrained`` writes, so that ``from_pretrained``, torchtitan's HF loader and every HF
tool start from it.

The directory holds ``model.safetensors``, or when the weights exceed ``max_shard_size``
``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` (``weight_map``
and ``metadata.total_size`` / ``total_parameters``), split as ``save_pretrained`` splits:
tensors in the state dict's order, a new file when the next tensor would overflow the
current one, a tensor larger than the limit in a file of its own. ``config.json`` (and
``generation_config.json``) come from the model's configuration.

[Note: tied weights in an HF directory]
``save_pretrained`` stores a tied weight once: of each set of names sharing a tensor it
drops those matching the model class's ``_tied_weights_keys`` (``lm_head.weight``), and
``from_pretrained`` ties them again from the config. We drop the same names, taken from the
configuration's architecture when there is one, else every alias but the name the weight
was first registered under; either way ``from_pretrained`` reports nothing missing.

[Note: an HF directory is replaced whole or not at all]
Every file is written under a hidden temporary name first; only when all of them are on
disk are they renamed into place, the index last, and shard files of an earlier save that
the new index does not name removed. A failure before that removes the temporary files and
leaves the directory as it was.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from ..._xla.private_api import tied_weights_patterns
from ..files import CheckpointError, SafetensorsWriter, atomic_paths
from ..files.writer import SAFETENSORS_DTYPES
from ..formats.consolidated import HF_INDEX, HF_WEIGHTS

DEFAULT_MAX_SHARD_SIZE = "5GB"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

Spec = Tuple[str, torch.dtype, Tuple[int, ...]]


def parse_size(size: Any) -> int:
    """``5GB`` (10**9, as ``save_pretrained`` reads it), ``500MiB`` or a number of bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", str(size), re.IGNORECASE)
    if not match or match.group(2).upper() not in _UNITS:
        raise CheckpointError(f"max_shard_size {size!r} is not a size such as '5GB' or '500MiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _nbytes(spec: Spec) -> int:
    return math.prod(spec[2]) * spec[1].itemsize


def split_into_files(specs: Sequence[Spec], max_bytes: int) -> List[Tuple[str, List[Spec]]]:
    """(file name, its entries) in order; one file is named ``model.safetensors``."""
    per_file: List[List[Spec]] = []
    current: List[Spec] = []  # still filling; a tensor over the limit gets a file before it
    size = 0
    for spec in specs:
        n = _nbytes(spec)
        if n > max_bytes:
            per_file.append([spec])
            continue
        if current and size + n > max_bytes:
            per_file.append(current)
            current, size = [], 0
        current.append(spec)
        size += n
    if current:
        per_file.append(current)
    if len(per_file) <= 1:
        return [(HF_WEIGHTS, list(specs))]
    return [(f"model-{i + 1:05d}-of-{len(per_file):05d}.safetensors", g)
            for i, g in enumerate(per_file)]


def tied_names_to_drop(aliases: Iterable[Tuple[str, str]],
                       tied_patterns: Optional[Sequence[str]]) -> List[str]:
    """The names ``save_pretrained`` leaves out (see [Note: tied weights in an HF
    directory]): ``aliases`` are (alias, source) pairs of one tensor's names."""
    sets: Dict[str, List[str]] = {}
    for alias, source in aliases:
        sets.setdefault(source, [source]).append(alias)
    drop = []
    for names in sets.values():  # the first-registered name first
        matching = [n for n in sorted(names)
                    if tied_patterns and any(re.search(p, n) for p in tied_patterns)]
        matching = matching[:len(names) - 1]
        drop += matching + [n for n in names if n not in matching][1:]
    return drop


# -- the configuration ------------------------------------------------------------------------
def read_config_files(hf_config: str) -> Dict[str, bytes]:
    """``config.json`` (and ``generation_config.json`` beside it) from a file or directory."""
    path = os.path.join(hf_config, "config.json") if os.path.isdir(hf_config) else hf_config
    if not os.path.isfile(path):
        raise CheckpointError(f"--hf_config {hf_config}: no config.json there")
    out = {"config.json": open(path, "rb").read()}
    generation = os.path.join(os.path.dirname(path), "generation_config.json")
    if os.path.isfile(generation):
        out["generation_config.json"] = open(generation, "rb").read()
    try:
        json.loads(out["config.json"])
    except ValueError as exc:
        raise CheckpointError(f"{path} is not JSON: {exc}") from None
    return out


def model_of_config(config_json: bytes, where: str) -> Optional[torch.nn.Module]:
    """The configuration's architecture built on the meta device (no memory), or None when
    the configuration names none transformers knows."""
    config = json.loads(config_json)
    architectures = config.get("architectures") or []
    try:
        import transformers
    except ImportError:
        return None
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is None:
        return None
    try:
        hf_config = transformers.AutoConfig.for_model(**config)
        with torch.device("meta"):
            return cls(hf_config)
    except Exception as exc:  # a config transformers cannot build is the user's to fix
        raise CheckpointError(f"{where}: transformers cannot build {architectures[0]} from "
                              f"it: {exc}") from None


def tied_patterns_of(model: torch.nn.Module) -> List[str]:
    """Every ``_tied_weights_keys`` pattern in ``model``, qualified by its module's path."""
    out = []
    for path, module in model.named_modules():
        keys = tied_weights_patterns(module)
        out += [f"{re.escape(path)}\\.{k}" if path else k for k in keys]
    return out


def check_against_config(specs: Sequence[Spec], dropped: Sequence[str],
                         model: torch.nn.Module, where: str) -> None:
    """The weights must be the configuration's model's: the same names and shapes."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = {name: tuple(shape) for name, _, shape in specs}
    missing = sorted(set(expected) - set(ours) - set(dropped))
    unexpected = sorted(set(ours) - set(expected))
    wrong = sorted(f"{n}: weights {list(ours[n])}, config {list(expected[n])}"
                   for n in set(ours) & set(expected) if ours[n] != expected[n])
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{where} does not describe these weights: missing {missing[:10]}, unexpected "
            f"{unexpected[:10]}, shapes {wrong[:10]}")


# -- writing ----------------------------------------------------------------------------------
def stored_order(specs: Sequence[Spec], aliases: Sequence[Tuple[str, str]],
                 dropped: Iterable[str]) -> List[Tuple[Spec, str]]:
    """(entry as stored, the entry whose tensor it is) in the order they are written: each
    tensor under each of its kept names as soon as it is read."""
    dropped = set(dropped)
    names_of: Dict[str, List[str]] = {}
    for alias, source in aliases:
        names_of.setdefault(source, []).append(alias)
    out = []
    alias_names = {a for a, _ in aliases}
    for name, dtype, shape in specs:
        if name in alias_names:
            continue
        for stored in [name] + names_of.get(name, []):
            if stored not in dropped:
                out.append(((stored, dtype, tuple(shape)), name))
    return out


def write_hf_directory(directory: str, order: Sequence[Tuple[Spec, str]],
                       entries: Iterator[Tuple[str, torch.Tensor]], configs: Dict[str, bytes],
                       max_shard_size: Any, progress: Callable[[int], None]) -> None:
    """Writes the directory from ``entries`` (name, tensor), each stored as ``order``
    (``stored_order``) says, the index last."""
    stored = [spec for spec, _ in order]
    for name, dtype, _ in stored:
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{name} has dtype {dtype}, which safetensors cannot hold")
    files = split_into_files(stored, parse_size(max_shard_size))
    file_of = {spec[0]: f for f, file_entries in files for spec in file_entries}
    entries_of = dict(files)
    stored_as: Dict[str, List[str]] = {}
    for (name, _, _), source in order:
        stored_as.setdefault(source, []).append(name)
    names = [f for f, _ in files] + list(configs) + ([HF_INDEX] if len(files) > 1 else [])
    # a file is a run of the writing order, except one holding a tensor over the limit alone,
    # which comes before the file still filling (as huggingface_hub splits): so each file is
    # opened at its first tensor and finished at its last, at most two open at once. The
    # index goes in place last: a reader never sees it name a file not yet in place
    with atomic_paths([os.path.join(directory, f) for f in names]) as by_path, \
            contextlib.ExitStack() as open_files:
        staged = {os.path.basename(p): file for p, file in by_path.items()}
        writers: Dict[str, Tuple[SafetensorsWriter, contextlib.ExitStack]] = {}
        left = {f: len(file_entries) for f, file_entries in files}
        for source, tensor in entries:
            progress(tensor.numel())
            for name in stored_as.get(source, []):
                f = file_of[name]
                if f not in writers:
                    closer = open_files.enter_context(contextlib.ExitStack())
                    tmp = closer.enter_context(staged[f].writing())
                    writers[f] = SafetensorsWriter(tmp, entries_of[f], {"format": "pt"}), closer
                writer, closer = writers[f]
                writer.add(name, tensor)
                left[f] -= 1
                if not left[f]:
                    writer.finish()
                    closer.close()
        unfinished = [f for f, n in left.items() if n]
        if unfinished:
            raise CheckpointError(f"{directory}: the weights ended before {unfinished[0]} "
                                  f"was complete")
        contents = dict(configs)
        if len(files) > 1:
            index = {"metadata": {"total_parameters": sum(math.prod(s) for _, _, s in stored),
                                  "total_size": sum(_nbytes(s) for s in stored)},
                     "weight_map": file_of}
            contents[HF_INDEX] = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        for name, data in contents.items():
            with staged[name].writing() as tmp, open(tmp, "wb") as out:
                out.write(data)
    for f in os.listdir(directory):
        if (_SHARD_FILE.fullmatch(f) or f in (HF_WEIGHTS, HF_INDEX)) and f not in staged:
            os.remove(os.path.join(directory, f))  # an earlier save's, not in the new index


def hf_directory(directory: str, specs: Sequence[Spec], entries: Iterator[Tuple[str, torch.Tensor]],
                 aliases: Sequence[Tuple[str, str]], hf_config: str,
                 model: Optional[torch.nn.Module], max_shard_size: Any,
                 progress: Callable[[int], None]
                 ) -> Tuple[List[str], Dict[str, Tuple[torch.dtype, Tuple[int, ...]]]]:
    """Checks the weights against the configuration and writes the directory; returns
    ``[directory]`` and what it stores: {name: (dtype, shape)}, tied weights dropped.

    The configuration is ``hf_config`` (a path) when given, else ``model.config`` (the
    unwrapped model's own, from training code), else none: then no ``config.json`` is
    written, and tied weights are stored once under their first-registered name."""
    _refuse_adapter_names(specs)
    configs: Dict[str, bytes] = {}
    where = hf_config
    if hf_config:
        configs = read_config_files(hf_config)
    elif hasattr(getattr(model, "config", None), "to_json_string"):
        config = json.loads(model.config.to_json_string())
        if not config.get("architectures"):   # save_pretrained names the model's class too
            config["architectures"] = [type(model).__name__]
        configs["config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
        generation = getattr(model, "generation_config", None)
        if hasattr(generation, "to_json_string"):
            configs["generation_config.json"] = generation.to_json_string().encode()
        where = f"the configuration of {type(model).__name__}"
    if not configs and os.path.exists(os.path.join(directory, "config.json")):
        raise CheckpointError(
            f"{directory} holds a config.json, which this save, given no configuration, would "
            f"leave beside weights it may not describe: pass hf_config (--hf_config), or write "
            f"to another directory")
    reference = model_of_config(configs["config.json"], where) if configs else None
    if configs and reference is None:
        print(f"{where}: names no architecture transformers knows, so the weights were not "
              f"checked against it")
    patterns = tied_patterns_of(reference) if reference is not None else None
    dropped = tied_names_to_drop(aliases, patterns)
    if reference is not None:
        check_against_config(specs, dropped, reference, where)
    order = stored_order(specs, aliases, dropped)
    write_hf_directory(directory, order, entries, configs, max_shard_size, progress)
    return [directory], {n: (d, s) for (n, d, s), _ in order}


_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.",
                  ".modules_to_save.", ".original_module.")


def _refuse_adapter_names(specs: Sequence[Spec]) -> None:
    """A PEFT model's weights carry its wrapper's names (``base_model.model.``) and unmerged
    adapters, which no ``from_pretrained`` of the base architecture loads: refused, with the
    two routes that give a loadable directory."""
    found = [name for name, _, _ in specs
             if name.startswith("base_model.model.") or any(p in name for p in _ADAPTER_PARTS)]
    if found:
        raise CheckpointError(
            f"--format hf / format='hf': these are the weights of a PEFT model ({found[0]}"
            f"{' ...' if len(found) > 1 else ''}), not of a Hugging Face architecture. Save "
            f"its adapter with the PeftModel's save_pretrained(dir, state_dict="
            f"model.full_state_dict()), or consolidate to .pth, load it into the unwrapped "
            f"PeftModel and save merge_and_unload() with save_pretrained")
