"""Checkpoints in ``torch.distributed.checkpoint`` (DCP) format, in the layout PyTorch FSDP2 and
torchtitan use (``layout``): ``save_dcp`` and ``load_dcp`` from training code."""
from .load import load_dcp
from .save import save_dcp

__all__ = ["save_dcp", "load_dcp"]
