"""DCP checkpoints that PyTorch FSDP2 and torchtitan read and write, in the layout of
``formats.dcp``: ``save_dcp``, each rank writing its own chunks (``writers.dcp_shards``), and
``load_dcp``, a DCP directory read at any world size, whoever wrote it (``save_dcp``, FSDP2's
``get_state_dict`` + ``dcp.save``, torchtitan, a plain single-process ``dcp.save``): each
rank asks DCP for its own chunks and reads only the saved chunks that overlap them
(``sources.dcp_files``), checked and staged as for every source (``staging``).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from .._xla.trace_only import refuse_reads
from .formats.dcp.metadata_file import METADATA_FILE
from .sources.dcp_files import DcpSource
from .staging import load_staged
from .unit_protocol import ShardedModel
from .live_model import require_root, sharding_group_load_path
from .writers.dcp_shards import save_dcp


def load_dcp(checkpoint_dir: str, model: ShardedModel,
             optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
    """Loads ``checkpoint_dir`` into ``model`` (and ``optimizer``); returns what was saved as
    ``extra`` (None if nothing was). Every rank calls it. Raises ``CheckpointError``, naming
    the key or file at fault, and changes nothing, if the checkpoint does not fit."""
    require_root(model, "load_dcp")
    refuse_reads(checkpoint_dir)
    directory = sharding_group_load_path(
        checkpoint_dir, model, lambda d: os.path.exists(os.path.join(d, METADATA_FILE)))
    return load_staged(lambda: DcpSource(directory), model, optimizer,
                       "xla_fsdp.load_dcp").extra


__all__ = ["save_dcp", "load_dcp"]
