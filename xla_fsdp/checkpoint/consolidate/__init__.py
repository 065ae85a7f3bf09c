"""``consolidate_sharded_ckpts``: per-rank FSDP checkpoints merged into one state dict, or
redistributed over another number of ranks (its ``--reshard N``). ``python -m
xla_fsdp.checkpoint.consolidate`` runs it."""
from .cli import main, run

__all__ = ["main", "run"]
