"""Consolidation and resharding of per-rank FSDP checkpoints (``consolidate_sharded_ckpts``)."""
from .cli import main, run

__all__ = ["main", "run"]
