"""Checkpoints of an FSDP model: per-rank files (``save_sharded``/``load_sharded``, in
torch_xla's format with a record of ours), the unwrapped model's full state dict, the format
itself (``metadata``), the file reading and writing under them (``files``), and the
``consolidate_sharded_ckpts`` tool (``consolidate``)."""
from .files import CheckpointError
from .metadata import sharded_checkpoint_path
from .sharded import load_sharded, save_sharded

__all__ = ["save_sharded", "load_sharded", "sharded_checkpoint_path", "CheckpointError"]
