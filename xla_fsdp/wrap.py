"""Auto-wrap policies and the recursive wrapper, with torch_xla's signatures.

A policy is called as ``policy(module, recurse, unwrapped_params)``. With ``recurse=True``
it answers "should the walk descend into this module's children?"; with ``recurse=False``,
"should this module become its own FSDP unit?". ``unwrapped_params`` counts the parameters
below ``module`` that no inner unit has taken yet.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Callable, Dict, Iterable, Optional, Set, Tuple, Type

import torch.nn as nn

from ._init.compiled_module import split_compiled
from ._unit.shard_group import shard_group_of
from ._unit.unit_state import is_unit
from ._xla.private_api import wrap_overrides


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wraps every module (and descends into every module)."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Wraps the modules for which ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                                 transformer_layer_cls: Iterable[Type[nn.Module]]) -> bool:
    """Wraps every instance of the given layer classes (e.g. a transformer block)."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


FORCE_LEAF_MODULES = {nn.MultiheadAttention}
EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: Optional[Set[Type[nn.Module]]] = None,
                                exclude_wrap_modules: Optional[Set[Type[nn.Module]]] = None
                                ) -> bool:
    """Wraps a module once its not-yet-wrapped parameters reach ``min_num_params``.

    Does not descend into ``force_leaf_modules`` and never wraps ``exclude_wrap_modules``
    (containers without a forward)."""
    leaves = FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules
    excluded = EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules
    if recurse:
        return not isinstance(module, tuple(leaves))
    return unwrapped_params >= min_num_params and not isinstance(module, tuple(excluded))


def recursive_wrap(module: nn.Module, auto_wrap_policy: Callable, wrapper_cls: Callable,
                   ignored_modules: Optional[Iterable[nn.Module]] = None,
                   ignored_params: Optional[Iterable] = None,
                   only_wrap_children: bool = False, **kwargs: Any) -> Tuple[nn.Module, int]:
    """Wraps ``module``'s subtree bottom-up as the policy says.

    Returns the (possibly wrapped) module and the number of parameters that are now inside
    units created here. With ``only_wrap_children`` the module itself is never wrapped (the
    caller wraps it as the root), but its children are replaced in place."""
    ignored_modules = set(ignored_modules or ())
    ignored_ids = {id(p) for p in ignored_params or ()}
    return _wrap(module, auto_wrap_policy, wrapper_cls, ignored_modules, ignored_ids,
                 only_wrap_children, kwargs, _registrations(module), {})


def _registrations(module: nn.Module) -> Counter:
    """How many modules below ``module`` register each parameter (by id); a module reached
    twice (one block object in two places) counts once."""
    return Counter(id(p) for m in module.modules() for _, p in m.named_parameters(recurse=False))


def _shared_outside(module: nn.Module, registrations: Counter,
                    ignored_ids: Set[int]) -> Optional[str]:
    """[Note: a tie is not split by a policy] The name of a parameter of ``module`` that a
    module outside it registers too (an embedding whose weight a head outside shares), or
    None. A unit around it would shard the tie away from its other module, which FSDP
    refuses, and a policy is not the user naming that split (a size policy wraps the
    embedding, or the body without the head, by counting). Such a module is left to the
    unit above, which holds both, with a warning naming the parameter."""
    inside = _registrations(module)
    return next((n for n, p in module.named_parameters() if id(p) not in ignored_ids
                 and registrations[id(p)] > inside[id(p)]), None)


def _unwrapped_numel(module: nn.Module, ignored_ids: Set[int]) -> int:
    if is_unit(module):
        return 0
    return sum(p.numel() for p in module.parameters()
               if id(p) not in ignored_ids and shard_group_of(p) is None)


def _wrap(module: nn.Module, policy: Callable, wrapper_cls: Callable,
          ignored_modules: Set[nn.Module], ignored_ids: Set[int], only_children: bool,
          kwargs: Dict[str, Any], registrations: Counter,
          done: Dict[int, nn.Module]) -> Tuple[nn.Module, int]:
    # a module registered in several places (``nn.ModuleList([block] * 3)``) is wrapped once
    # and that unit put in each place (see [Note: a unit under several paths] in
    # ``checkpoint.live_model``); its parameters are counted once
    if id(module) in done:
        return done[id(module)], 0
    # an existing unit (e.g. ScannedLayers) has sharded its subtree already: wrapping inside
    # it would build units around its placeholders
    if module in ignored_modules or is_unit(module):
        return module, 0
    # a compiled module is judged and walked as the module it compiles, and wrapped whole
    inner, _ = split_compiled(module)
    if not policy(module=inner, recurse=True,
                  unwrapped_params=_unwrapped_numel(inner, ignored_ids)):
        return module, 0
    wrapped_total = 0
    # every place a child is registered at, a repeated one too (named_children gives one)
    for name, child in [(n, m) for n, m in inner.named_modules(remove_duplicate=False)
                        if n and "." not in n]:
        new_child, count = _wrap(child, policy, wrapper_cls, ignored_modules, ignored_ids,
                                 False, kwargs, registrations, done)
        if new_child is not child:
            setattr(inner, name, new_child)
            done[id(child)] = new_child
        wrapped_total += count
    remaining = _unwrapped_numel(inner, ignored_ids)
    if not only_children and policy(module=inner, recurse=False, unwrapped_params=remaining):
        tied = _shared_outside(inner, registrations, ignored_ids)
        if tied is None:
            # fairscale's and torch_xla's convention: a module's own options over the policy's
            return wrapper_cls(module, **{**kwargs, **wrap_overrides(inner)}), \
                wrapped_total + remaining
        warnings.warn(f"auto_wrap_policy: {type(inner).__name__} is not wrapped in a unit of "
                      f"its own: its parameter '{tied}' is shared with a module outside it, so "
                      f"the unit above holds it (see [Note: a tie is not split by a policy])")
    return module, wrapped_total
