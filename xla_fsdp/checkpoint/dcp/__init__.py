"""``save_dcp`` (``save``) and ``load_dcp`` (``load``): a wrapped model and its optimizer to and
from a ``torch.distributed.checkpoint`` (DCP) directory that PyTorch FSDP2 and torchtitan
read and write, in the format of ``dcp_format``."""
from .load import load_dcp
from .save import save_dcp

__all__ = ["save_dcp", "load_dcp"]
