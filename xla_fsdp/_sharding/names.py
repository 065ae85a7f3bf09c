"""Names in a wrapped model, as they are in the unwrapped one.

Wrappers insert path components that the unwrapped model does not have: ours
(``_fsdp_wrapped_module``, and ``_fsdp_group_<i>`` where a unit grouping several modules is
attached), torch_xla's flattener (``_fpw_module``) and torch's checkpoint wrapper
(``_checkpoint_wrapped_module``). Checkpoints and state dicts drop them.
"""
from __future__ import annotations

WRAPPER_PARTS = ("_fsdp_wrapped_module", "_fpw_module", "_checkpoint_wrapped_module")
GROUP_PREFIX = "_fsdp_group_"  # where a unit grouping several modules is attached
SHARD_PREFIX = "_fsdp_shard"   # how every shard's name (its state dict key's last part) begins


def clean_name(name: str) -> str:
    """A name (or module path) in the wrapped model as it is in the unwrapped one."""
    return ".".join(p for p in name.split(".")
                    if p and p not in WRAPPER_PARTS and not p.startswith(GROUP_PREFIX))


def join_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
