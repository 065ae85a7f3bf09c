"""Consolidated checkpoints of a tiny tied-embedding Llama, written by other tools (Hugging
Face's ``save_pretrained``, ``safetensors``, ``torch.save``), loaded into the sharded model
with ``load_consolidated`` and ``load_full_optim_state_dict``, and training continued."""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, Dict, List

import torch
# Imported here, never inside the launched function: lazy imports race in device threads.
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from xla_fsdp.wrap import transformer_auto_wrap_policy

from .consolidated_workloads import CONFIG
from .checks import every

LR, STEPS = 1e-2, 3
GLOBAL_BATCH = 4


def llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def write_corrupted(path: str, state: Dict[str, torch.Tensor], name: str) -> None:
    """``state`` as our safetensors writer writes it, one byte of ``name`` flipped after."""
    import json
    import struct

    from xla_fsdp.checkpoint.files.writer import SafetensorsWriter
    writer = SafetensorsWriter(path, [(k, v.dtype, tuple(v.shape)) for k, v in state.items()],
                               {"format": "pt"})
    for k, v in state.items():
        writer.add(k, v)
    writer.finish()
    data = bytearray(open(path, "rb").read())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 + length + json.loads(data[8:8 + length])[name]["data_offsets"][0] + 5] ^= 0x10
    open(path, "wb").write(data)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, 8), generator=g)


def trained_state() -> Dict[str, Any]:
    """One AdamW step of the unwrapped model on the CPU: the state every file holds."""
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = batch(-1)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    names = [n for n, _ in model.named_parameters()]  # the optimizer's order
    osd = opt.state_dict()
    by_name = {"state": {names[i]: s for i, s in osd["state"].items()},
               "param_groups": [dict(g, params=[names[i] for i in g["params"]])
                                for g in osd["param_groups"]]}
    return {"model": model, "sd": {k: v.clone() for k, v in model.state_dict().items()},
            "osd": osd, "names": names, "osd_by_name": by_name}


class ReadCounter:
    """Bytes each rank (device thread) reads from checkpoint files, counted around the two
    readers' ``pread_into``."""

    def __init__(self) -> None:
        self.by_rank: Dict[int, int] = {}
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> None:
        from xla_fsdp.checkpoint.files import CheckpointFile, SafetensorsFile
        with self._lock:
            if self._installed:
                return
            self._installed = True
        for cls in (CheckpointFile, SafetensorsFile):
            original = cls.pread_into

            def counted(file, key, offset, out, original=original):
                import torch_xla.runtime as xr
                original(file, key, offset, out)
                with self._lock:
                    rank = xr.global_ordinal()
                    self.by_rank[rank] = self.by_rank.get(rank, 0) + memoryview(out).nbytes
            cls.pread_into = counted


COUNTER = ReadCounter()


def _wrapped(seed: int):
    from xla_fsdp import FSDP
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(llama(seed), auto_wrap_policy=policy, flatten_parameters=True)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _train(model, opt, rank: int, world: int) -> List[float]:
    import torch_xla
    import torch_xla.core.xla_model as xm
    local = GLOBAL_BATCH // world
    losses = []
    for step in range(STEPS):
        ids = batch(step)[rank * local:(rank + 1) * local].to(torch_xla.device())
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        total = xm.all_reduce(xm.REDUCE_SUM, loss.detach(), scale=1.0 / world) if world > 1 \
            else loss.detach()
        torch_xla.sync()
        losses.append(total.item())
    return losses


PARTIAL_DROPPED = "model.layers.0.mlp.up_proj.weight"  # in a flattened decoder layer's shard


def _attempt(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return ""


def load_everything(rank: int, root: str, train: bool) -> Dict[str, Any]:
    """Every format loaded into a model initialised differently; the full state after each,
    the bytes each load read on this rank, bad inputs refused, and (with ``train``) the losses
    of training continued after each way of loading."""
    import torch_xla
    import torch_xla.runtime as xr
    from xla_fsdp.checkpoint import load_consolidated, save_consolidated
    import torch_xla.core.xla_model as xm
    world = xr.world_size()
    counter = COUNTER
    counter.install()
    xm.rendezvous("xla_fsdp.test.counter")  # installed before any rank reads
    out: Dict[str, Any] = {"full": {}, "bytes": {}, "errors": {}}
    for name, path, with_opt in (("pt", "ck.pth", True), ("safetensors", "ck.safetensors", True),
                                 ("hf", "hf", False)):
        model, opt = _wrapped(seed=1)
        before = dict(counter.by_rank)
        extra = load_consolidated(os.path.join(root, path), model, opt if with_opt else None)
        xr_rank = xr.global_ordinal()
        out["bytes"][name] = counter.by_rank.get(xr_rank, 0) - before.get(xr_rank, 0)
        out["full"][name] = model.full_state_dict(rank0_only=False)
        out[f"extra_{name}"] = extra
        if name == "pt":
            # the launches at N = 2 and 4 share root: each world size's save is checked
            own = os.path.join(root, f"rank-{rank}-of-{world}")
            os.makedirs(own, exist_ok=True)
            save_consolidated(os.path.join(own, "back.pth"), model, opt)
            if train:
                out["losses_pt"] = _train(model, opt, rank, world)
    # only host 0 has the checkpoint: every rank is given a directory of its own
    host = os.path.join(root, f"host-{rank}")
    model, opt = _wrapped(seed=1)
    load_consolidated(os.path.join(host, "ck.pth"), model, opt, first_rank_reads=True)
    out["full"]["first_rank"] = model.full_state_dict(rank0_only=False)
    out["host_files"] = sorted(os.listdir(host)) if os.path.isdir(host) else None
    if train:
        out["losses_first_rank"] = _train(model, opt, rank, world)
        # a full state dict and a get_state_dict-style optimizer state, in memory
        state = torch.load(os.path.join(root, "ck.pth"), weights_only=True)
        by_name = torch.load(os.path.join(root, "osd_by_name.pt"), weights_only=True)
        model, opt = _wrapped(seed=1)
        model.load_full_state_dict(state["model"])
        model.load_full_optim_state_dict(opt, by_name)
        out["losses_in_memory"] = _train(model, opt, rank, world)
        out["trained_full"] = model.full_state_dict(rank0_only=False)
    # bad input: each refused on every rank, the model left as it was
    model, opt = _wrapped(seed=1)
    untouched = model.full_state_dict(rank0_only=False)
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out["errors"]["missing_shard"] = _attempt(
        lambda: load_consolidated(os.path.join(root, "hf_missing_shard"), model))
    out["errors"]["wrong_config"] = _attempt(
        lambda: load_consolidated(os.path.join(root, "hf_wide"), model))
    out["errors"]["other_optimizer"] = _attempt(
        lambda: load_consolidated(os.path.join(root, "ck.pth"), model, sgd))
    out["errors"]["no_companion"] = _attempt(
        lambda: load_consolidated(os.path.join(root, "lone.safetensors"), model, opt))
    out["errors"]["corrupted"] = _attempt(
        lambda: load_consolidated(os.path.join(root, "corrupted.safetensors"), model))
    out["errors"]["unnamed_optimizer"] = _attempt(
        lambda: model.load_full_optim_state_dict(opt, torch.load(
            os.path.join(root, "ck.pth"), weights_only=True)["optimizer"]))
    # a state dict lacking one parameter of a flattened shard group, with a key the model
    # lacks: refused when strict; otherwise loaded, the lacking parameter kept as it was
    partial = torch.load(os.path.join(root, "ck.pth"), weights_only=True)["model"]
    del partial[PARTIAL_DROPPED]
    partial["not_in_the_model"] = torch.zeros(1)
    out["errors"]["strict_partial"] = _attempt(lambda: model.load_full_state_dict(partial))
    out["unchanged_after_errors"] = every(
        torch.equal(v, untouched[k]) for k, v in model.full_state_dict(rank0_only=False).items())
    missing, unexpected = model.load_full_state_dict(partial, strict=False)
    after = model.full_state_dict(rank0_only=False)
    out["non_strict"] = (missing, unexpected,
                         torch.equal(after[PARTIAL_DROPPED], untouched[PARTIAL_DROPPED]),
                         every(torch.equal(after[k], v) for k, v in partial.items()
                               if k != "not_in_the_model"))
    if not train:  # on every rank: a sync is a collective point on the virtual devices
        out["reference"] = _reference(root)
    torch_xla.sync()
    return out


def _reference(root: str) -> Dict[str, Any]:
    """Training continued unsharded on one XLA device from the same state."""
    import torch_xla
    state = torch.load(os.path.join(root, "ck.pth"), weights_only=True)
    device = torch_xla.device()
    model = llama(seed=1)
    model.load_state_dict(state["model"])
    model.to(device)
    model.tie_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    opt.load_state_dict(state["optimizer"])
    losses = []
    for step in range(STEPS):
        ids = batch(step).to(device)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        torch_xla.sync()
        losses.append(loss.item())
    params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params}
