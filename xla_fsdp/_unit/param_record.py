"""One record per original parameter of a unit: the placeholder that stands in its modules,
every place and name it has, and whether the placeholder holds the full value now. The
record owns the parameter's two transitions, to its full value and back, on both paths:
eagerly by swapping the placeholder's data (``install``, ``free``), and in a graph that
``torch.compile`` traces by setting the full value where the placeholder stands (``lend``,
``take_back``; see [Note: collectives traced into the compiled graph] in ``traced_unshard``).
The transitions are static methods over a unit's records, not one call per record: a unit's
placeholders swap under one version-counter guard (see [Note: per-step host cost] in
``unit_params``). A lent value is not held: it stands in the modules only while Dynamo traces
the forward, and the placeholder, still empty, is what the eager code sees, so ``lend``
leaves ``holds_full`` False. The gradients' side (what arrived, the reduction) belongs to
the unit's ``UnitParams``, which reduces a shard group's records together.

No FSDP state lives on tensors except what code written for torch_xla's FSDP reads there:
``_is_sharded``, ``_orig_size`` and ``_orig_name`` on a shard, and ``_has_full_param`` on a
placeholder (a unit's ``full_params``), whether it holds the full value now; our own code
tells a shard by ``shard_group.shard_group_of``, never by them. ``_has_full_param`` is a
copy of ``ParamRecord.holds_full``, the state FSDP itself reads, written by the two methods
that change it and nowhere else. The records are found from their tensors through
identity-keyed weak maps, so a tensor that dies takes its entry with it.

[Note: swapping .data]
The placeholder is one leaf tensor per parameter, kept for the unit's lifetime, so autograd
delivers one gradient per parameter to a hook registered once. Installing the gathered
value assigns ``.data``. torch_xla's ``_replace_xla_tensor`` would avoid ``set_`` but keeps
the old ``numel()`` (torch_xla gets away with it because its placeholders keep full size;
ours are empty, so nothing full-size ever reaches the device outside the gather), and
XLA tensors have no storage to resize as FSDP2 does on GPU. The swap is confined to
``ParamRecord.install``/``free`` below, the one place to change when a functional gather
(all-gather whose backward reduce-scatters) replaces placeholders.

[Note: writes to a freed placeholder]
Between a unit's forwards its modules' attributes hold the empty placeholders, so an
in-place update through them (a weight clamp or an EMA written as
``module.weight.clamp_(...)`` under ``no_grad``, as on the unwrapped model) changes the
placeholder and is lost: the next gather installs the shards' values. torch_xla's FSDP loses
it without a word. Each record keeps the placeholder's version counter as of its freeing
(the swaps themselves keep the counter), and ``install`` refuses a placeholder whose counter
moved since, naming the parameter. A write through ``.data`` shares no counter and is not
seen; updates belong on the shards, which ``model.parameters()`` yields.

[Note: writes to a held full value]
While a unit holds its full parameters (its forward, a backward, an ``unshard()``), what its
modules read is a gathered copy that ``free`` drops. A write to it in place is lost:
``nn.Embedding(max_norm=...)`` renormalising its rows, a forward that clamps its own
weight. On the unwrapped model the write persists, so ``free`` compares the placeholder's
version counter with the one of its install and refuses a change, naming the parameter,
after putting every dummy back. Two callers keep the writes and pass: ``apply``, which
writes them back to the shards, and a pass that raised, which drops them on purpose. A
write through ``.data`` is not seen here either.

[Note: a freed placeholder is empty]
A freed placeholder holds zero elements, not torch_xla's one. Code that reads a parameter
outside its unit's forward (a parent's forward multiplying by a child unit's scalar gain,
an evaluation under ``no_grad``, a frozen parameter) gets the placeholder: with one element
of zeros it broadcast against anything and computed a silently wrong result, which only a
gradient arriving in backward could reveal, and frozen parameters or ``no_grad`` never get
there. An empty tensor broadcasts against nothing but a dimension of one, but a reduction
of it does not fail (its sum or norm is 0, its mean nan): a penalty or a logged norm over a
parameter read outside its unit was wrong without a word. So a freed placeholder is also
of class ``FreedPlaceholder``, whose ``__torch_function__`` refuses any op that reads its
values (``.data`` and views of them included), naming the parameter; what reads its
metadata (shape, dtype, device, ``.grad``, hooks, ``new_zeros``) passes. ``install`` makes it a plain tensor again (``__class__`` is swapped, which
costs nothing an op pays), so the unit's forward and backward run without the check. Code
that reads a parameter outside its unit belongs inside that unit, or calls the unit's
``unshard()`` first.

[Note: a taken parameter is empty]
Sharding removes an original parameter from its modules, but not from what else holds it: a
module that keeps it in a list or a closure, a hook that captured it, an average built from
``model.parameters()`` before wrapping. Left whole, it kept its value of wrapping time and
its device memory, and code reading it trained on a stale copy without a word (its gradient
reached nothing). Emptied, as a freed placeholder is, and of class ``TakenParameter``,
which refuses reads of its values as ``FreedPlaceholder`` does (a sum over it was 0), such
a read fails where it happens, naming the parameter, and the memory is really freed. A
frozen original keeps its value, which is still right (an embedding shared, frozen, with an
unwrapped teacher): unfrozen later through its shard, its stale value is the one case
left. A reference taken before wrapping is read through the module attribute instead,
inside the unit.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from .._xla.private_api import (call_as_tensor, dynamo_is_tracing, preserve_version_counter,
                                version)
from .registry import WeakRegistry

Owner = Tuple[nn.Module, str]  # a module and the attribute that holds the parameter
Member = Tuple[nn.Parameter, List[Owner], List[str]]  # a parameter, its holders, its names

_BY_PLACEHOLDER: "WeakRegistry[ParamRecord]" = WeakRegistry()
# a full value lent outside torch.compile (a scanned layer's trace) -> its record
_LENT: "WeakRegistry[ParamRecord]" = WeakRegistry()
# on a module holding placeholders: the attributes they stand at (a plain attribute of the
# module, so that listing a model's parameters finds them without a lookup per module;
# see ``hold_placeholder``)
_PLACEHOLDER_ATTRS = "_fsdp_placeholder_attributes"
# original parameter -> (its name in the unit that took it, that unit's name)
_TAKEN: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _passes(func: Callable) -> bool:
    """Whether ``func`` reads only metadata (or Dynamo inspects a tensor a traced forward
    puts back: see ``take_back``). A property passes unless it is a view of the values."""
    return func in _METADATA or getattr(func, "__name__", "") in ("__get__", "__set__") \
        and func not in _VIEWS or dynamo_is_tracing()


def _op_name(func: Callable) -> str:
    """``sum()``, or ``.T`` for a property."""
    name = getattr(func, "__name__", str(func))
    return f".{func.__self__.__name__}" if name == "__get__" else f"{name}()"


class FreedPlaceholder(torch.Tensor):
    """A placeholder between its unit's forwards (see [Note: a freed placeholder is
    empty]): empty, and refusing what reads its values."""

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Any = (),
                           kwargs: Optional[Mapping[str, Any]] = None) -> Any:
        freed = next((a for a in args if isinstance(a, FreedPlaceholder)), None)
        record = None if freed is None else _BY_PLACEHOLDER.get(freed)
        if func == _DATA and record is not None:
            # ``.data`` (a write through it was lost): an alias refusing the same reads
            alias = call_as_tensor(func, args, kwargs)
            alias.__class__ = FreedPlaceholder
            _BY_PLACEHOLDER[alias] = record
            return alias
        if _passes(func):
            return call_as_tensor(func, args, kwargs)
        what = ("a parameter" if record is None else
                f"parameter '{record.name}' of the FSDP unit around {record.unit_name}")
        raise RuntimeError(
            f"{_op_name(func)} read {what} outside the unit's forward, "
            f"where its module attribute is an empty placeholder, not the parameter: the "
            f"result would be of no elements, or 0 (see [Note: a freed placeholder is empty]). "
            f"Read it inside that unit's forward, after the unit's unshard(), or through "
            f"full_state_dict(); a method other than forward (generate()) runs inside "
            f"root.unshard() ... root.reshard(), or, under Lightning Fabric, once marked with "
            f"fabric.mark_forward_method. (In a backward: a reentrant torch.utils.checkpoint "
            f"run twice over the same modules of a unit recomputes after the unit's "
            f"reduction; pass use_reentrant=False.)")


class TakenParameter(nn.Parameter):
    """A trainable original parameter a unit took (see [Note: a taken parameter is empty]):
    empty, and refusing what reads its values, through whatever reference was kept."""

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Any = (),
                           kwargs: Optional[Mapping[str, Any]] = None) -> Any:
        if _passes(func):
            return call_as_tensor(func, args, kwargs)
        taken = next((taken_by(a) for a in args if isinstance(a, TakenParameter)), None)
        raise RuntimeError(
            f"{_op_name(func)} read the original parameter "
            f"{taken or 'of an FSDP unit'}, which the unit replaced by a shard and emptied (a "
            f"reference kept from before wrapping: a list, a closure, a hook, an optimizer or "
            f"an average built then; see [Note: a taken parameter is empty]). Read it through "
            f"its module attribute inside the unit's forward, or take model.parameters() "
            f"(the shards) after wrapping")


_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement,
             torch.Tensor.element_size, torch.Tensor.stride, torch.Tensor.storage_offset,
             torch.Tensor.is_floating_point, torch.Tensor.is_complex,
             torch.Tensor.is_contiguous, torch.Tensor.get_device, torch.Tensor.requires_grad_,
             torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
             torch.Tensor.__hash__, torch.Tensor.__repr__, torch.Tensor.__format__,
             torch.Tensor.__len__, torch.Tensor.__reduce_ex__, torch.Tensor.__deepcopy__,
             torch.Tensor.__setstate__, torch.Tensor.data_ptr, torch.Tensor.untyped_storage,
             torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty,
             torch.Tensor.new_full, torch.Tensor.new_tensor, torch.Tensor.type,
             torch.Tensor.is_pinned, torch.Tensor.is_shared, torch.is_floating_point,
             torch.numel, torch.is_complex}
# the properties that are views of the values
_DATA = torch.Tensor.data.__get__
_VIEWS = {_DATA, torch.Tensor.T.__get__, torch.Tensor.mT.__get__, torch.Tensor.H.__get__,
          torch.Tensor.mH.__get__, torch.Tensor.real.__get__, torch.Tensor.imag.__get__}


class ParamRecord:
    """An original parameter, replaced in its modules by ``placeholder``."""

    def __init__(self, placeholder: torch.Tensor, names: List[str], owners: List[Owner],
                 unit_name: str) -> None:
        self.placeholder = placeholder
        self.names = names            # relative to the unit; the first is the canonical one
        self.owners = owners
        self.unit_name = unit_name    # for error messages
        self.holds_full = False       # the placeholder holds the full value
        self.requires_grad = placeholder.requires_grad  # as last agreed with the shard
        self.grad_hook: Optional[RemovableHandle] = None
        self.freed_at = version(placeholder)   # see [Note: writes to a freed placeholder]
        placeholder._has_full_param = False  # torch_xla's name, for the code that reads it
        placeholder.__class__ = FreedPlaceholder
        _BY_PLACEHOLDER[placeholder] = self

    @property
    def name(self) -> str:
        return self.names[0]

    @staticmethod
    def install(records: Sequence["ParamRecord"], values: Sequence[torch.Tensor]) -> None:
        """Puts each full value into its record's placeholder (see [Note: swapping .data]).
        A unit's records swap together: one version-counter guard for all of them."""
        ParamRecord.refuse_lost_writes(records)
        placeholders = [r.placeholder for r in records]
        with preserve_version_counter(placeholders):
            for record, placeholder, value in zip(records, placeholders, values):
                placeholder.__class__ = torch.Tensor
                placeholder.data = value
                record.holds_full = placeholder._has_full_param = True

    @staticmethod
    def refuse_lost_writes(records: Sequence["ParamRecord"]) -> None:
        """Raises if a record's placeholder was written in place since it was last freed:
        before a gather would overwrite the write, and before a checkpoint would save the
        shards without it (see [Note: writes to a freed placeholder])."""
        for record in records:
            if version(record.placeholder) != record.freed_at:
                raise RuntimeError(
                    f"{record.unit_name}: parameter '{record.name}' was changed in place "
                    f"through its module attribute while the unit was sharded; that attribute "
                    f"is a placeholder between the unit's forwards, not the parameter, so the "
                    f"change would be lost (see [Note: writes to a freed placeholder]). Change "
                    f"the shards instead (model.parameters(), which the optimizer holds), or "
                    f"load a state dict")

    @staticmethod
    def free(records: Sequence["ParamRecord"], dummies: Sequence[torch.Tensor],
             writes_kept: bool = False) -> bool:
        """Puts each record's dummy back into its placeholder, where it holds a full value;
        returns whether any did. Unless the caller keeps what was written to the full
        values (``writes_kept``: it wrote them back, or it is abandoning a pass that
        raised), a full value written in place while held is refused after the swap (see
        [Note: writes to a held full value])."""
        held = [(r, d) for r, d in zip(records, dummies) if r.holds_full]
        if not held:
            return False
        written = [r for r, _ in held if version(r.placeholder) != r.freed_at]
        with preserve_version_counter([r.placeholder for r, _ in held]):
            for record, dummy in held:
                record.placeholder.data = dummy
                record.placeholder.__class__ = FreedPlaceholder
                record.holds_full = record.placeholder._has_full_param = False
                record.freed_at = version(record.placeholder)
        if written and not writes_kept:
            raise RuntimeError(
                f"{written[0].unit_name}: parameter '{written[0].name}' was changed in place "
                f"while the unit held its full value (e.g. nn.Embedding(max_norm=...), or a "
                f"clamp of the weight in forward). That value is a gathered copy, freed after "
                f"use, so the change would be lost (see [Note: writes to a held full value]). "
                f"Change the shards instead (model.parameters(), which the optimizer holds), "
                f"or inside model.apply(fn), whose writes reach them")
        return True

    @staticmethod
    def lend(records: Sequence["ParamRecord"], values: Sequence[torch.Tensor]) -> None:
        """In a traced forward: each full value set where its record's placeholder stands, in
        every module that holds it (a plain ``setattr``, which Dynamo replays)."""
        for record, value in zip(records, values):
            for module, attr in record.owners:
                setattr(module, attr, value)
            if not torch.compiler.is_compiling():   # a scanned layer's trace
                _LENT[value] = record

    @staticmethod
    def take_back(records: Sequence["ParamRecord"]) -> None:
        """The placeholders back where ``lend`` set the full values."""
        for record in records:
            for module, attr in record.owners:
                if not torch.compiler.is_compiling():
                    _LENT.pop(getattr(module, attr))
                setattr(module, attr, record.placeholder)

    def agree_requires_grad(self, requires_grad: bool, accumulating: bool = False) -> None:
        """Makes the placeholder trainable or frozen, as its shard is; a frozen one keeps no
        gradient, but the one a ``no_sync`` accumulation holds (``accumulating``), as torch
        keeps a frozen parameter's: frozen for a pass and unfrozen (peft's
        ``disable_adapter()`` around a reference forward), it is reduced with the rest."""
        self.placeholder.requires_grad_(requires_grad)
        self.requires_grad = requires_grad
        if not requires_grad and not accumulating:
            self.placeholder.grad = None

    def hook_gradient(self, fn: Callable[[], None]) -> None:
        """Calls ``fn()`` after every gradient accumulated into the placeholder, in any
        backward, for the unit's lifetime: registered once, so nothing piles up."""
        if self.grad_hook is None and self.placeholder.requires_grad:
            self.grad_hook = self.placeholder.register_post_accumulate_grad_hook(
                lambda _t: fn())


def any_placeholder() -> bool:
    """Whether any unit of the process has placeholders (a model is wrapped)."""
    return len(_BY_PLACEHOLDER) > 0


def hold_placeholder(module: nn.Module, attr: str, unit_name: str) -> None:
    """Records that ``module`` holds a placeholder of the unit around ``unit_name`` at
    ``attr``, where a load into it is refused; the first one makes its copies and its own
    ``state_dict()`` refuse."""
    held = module.__dict__.setdefault(_PLACEHOLDER_ATTRS, [])
    if not held:
        _refuse_copies_of(module, unit_name)
    if attr not in held:
        held.append(attr)
        _refuse_loads_into(module, attr, unit_name)


def placeholder_attributes(module: nn.Module) -> Sequence[str]:
    """The attributes at which ``module`` itself holds placeholders (or values lent in
    their place)."""
    return module.__dict__.get(_PLACEHOLDER_ATTRS, ())


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` stands where a parameter was: a placeholder, holding its full value or
    not, or a full value lent outside ``torch.compile``."""
    return t in _BY_PLACEHOLDER or t in _LENT


def placeholders_in(module: nn.Module) -> List[torch.Tensor]:
    """The placeholders that ``module`` and its submodules hold, each once: inside a unit,
    what stands where their parameters were."""
    held = {id(v): v for m in module.modules() for v in vars(m).values()
            if isinstance(v, torch.Tensor) and v in _BY_PLACEHOLDER}
    return list(held.values())


def mark_taken(original: torch.Tensor, name: str, unit_name: str) -> None:
    """Marks an original parameter as replaced by a shard, and empties it (see [Note: a
    taken parameter is empty])."""
    _TAKEN[original] = (name, unit_name)
    if original.requires_grad:
        original.data = torch.empty(0, dtype=original.dtype, device=original.device)
        original.grad = None
        if type(original) is nn.Parameter:
            original.__class__ = TakenParameter


def taken_name(t: torch.Tensor) -> Optional[str]:
    """The name of the parameter ``t`` was before FSDP took it (an original parameter or a
    placeholder), or None for a tensor FSDP never took."""
    record = _BY_PLACEHOLDER.get(t)
    if record is not None:
        return record.name
    taken = _TAKEN.get(t)
    return None if taken is None else taken[0]


def taken_by(t: torch.Tensor) -> Optional[str]:
    """Which unit took original parameter ``t``, and under what name, for a message."""
    taken = _TAKEN.get(t)
    return None if taken is None else f"'{taken[0]}' of the unit around {taken[1]}"


def _refuse_copies_of(module: nn.Module, unit_name: str) -> None:
    """Makes ``copy.deepcopy``, pickling (``torch.save``) and a ``state_dict()`` of
    ``module``, a module inside a unit that holds placeholders, or of any module above it,
    refuse: a copy would hold empty tensors (see [Note: a unit is not copied] in
    ``unit_module``), and a state dict would lack what the placeholders stand for (see
    [Note: state_dict() below a unit]). The copies look these up on the instance first."""
    what = (f"{type(module).__name__} holds parameters that the FSDP unit around {unit_name} "
            f"shards")

    def refuse(*_args: Any) -> Any:
        raise TypeError(
            f"{what}: a copy or a pickle of it would hold empty placeholders. Copy the model "
            f"before wrapping and wrap the copy the same way, or save the values with "
            f"full_state_dict()")

    def refuse_state_dict(_module: nn.Module, prefix: str, _keep_vars: bool) -> None:
        if not getattr(_UNIT_SAVING, "depth", 0):
            at = f" (at '{prefix[:-1]}' in the module called)" if prefix else ""
            raise TypeError(
                f"state_dict() of a module inside an FSDP unit: {what}{at}, and the state "
                f"dict would leave them out (and give nested units' flat shards). Call "
                f"root.full_state_dict() for the model's values under its own names (every "
                f"rank calls it; Fabric: XLAFSDPStrategy(state_dict_type='full')), or "
                f"state_dict() of the root FSDP model for this rank's shards")
    object.__setattr__(module, "__deepcopy__", refuse)
    object.__setattr__(module, "__reduce_ex__", refuse)
    module.register_state_dict_pre_hook(refuse_state_dict)


# [Note: state_dict() below a unit]
# The modules inside a unit hold placeholders, plain attributes that torch's state_dict()
# does not list, and nested units' flat shards under wrapper names. Through a unit's own
# state_dict() that is the sharded state dict, whose names its loaders read; called on a
# module inside it (Lightning's _FabricModule.state_dict(), an accelerate or user save of
# the inner model) it was a dict missing every parameter the units hold, saved without a
# word. The units count their state_dict() calls per thread (the virtual launcher runs a
# rank per thread), and a module holding placeholders refuses one made outside them.
_UNIT_SAVING = threading.local()


@contextlib.contextmanager
def unit_state_dict() -> Iterator[None]:
    """Marks this thread as inside a unit's ``state_dict()``, where the modules below it may
    be read (see [Note: state_dict() below a unit])."""
    depth = getattr(_UNIT_SAVING, "depth", 0)
    _UNIT_SAVING.depth = depth + 1
    try:
        yield
    finally:
        _UNIT_SAVING.depth = depth


def _refuse_loads_into(module: nn.Module, attr: str, unit_name: str) -> None:
    """Makes ``module.load_state_dict`` (or a parent's, below the unit) refuse a value for the
    placeholder at ``attr``: torch's loader sees no parameter there, so it would skip it, and
    under ``strict=False`` load nothing without a word. A load through the unit never names
    a placeholder (its state dict holds the shards)."""
    def hook(_module: nn.Module, state_dict: Mapping[str, Any], prefix: str,
             *_args: Any) -> None:
        if prefix + attr in state_dict:
            raise ValueError(
                f"load_state_dict() got {prefix + attr!r}, a parameter that the FSDP unit "
                f"around {unit_name} shards: the module holds an empty placeholder there, so "
                f"nothing would be loaded. Load through the root FSDP model, under the names "
                f"its full_state_dict() gives (strict=False for a part of the model).")
    module.register_load_state_dict_pre_hook(hook)
