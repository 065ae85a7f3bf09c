"""``load_dcp``: a DCP checkpoint in the layout of ``dcp_format.layout`` into a wrapped model
(and its optimizer) at any world size, whoever wrote it: ``save_dcp``, PyTorch FSDP2's
``get_state_dict`` + ``dcp.save``, torchtitan, or a plain single-process ``dcp.save``. Each
rank asks DCP for its own chunks, and reads only the saved chunks that overlap them
(``sources.dcp_files``); what it reads is checked and staged as for every source
(``staging``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..._xla.trace_only import refuse_reads
from ..sources.dcp_files import DcpSource
from ..staging import load_staged
from ..unit_protocol import ShardedModel
from ..live_model import require_root
from .save import checkpoint_dir_for


def load_dcp(checkpoint_dir: str, model: ShardedModel,
             optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
    """Loads ``checkpoint_dir`` into ``model`` (and ``optimizer``); returns what was saved as
    ``extra`` (None if nothing was). Every rank calls it. Raises ``CheckpointError``, naming
    the key or file at fault, and changes nothing, if the checkpoint does not fit."""
    require_root(model, "load_dcp")
    refuse_reads(checkpoint_dir)
    directory, _ = checkpoint_dir_for(checkpoint_dir, model)
    return load_staged(lambda: DcpSource(directory), model, optimizer,
                       "xla_fsdp.load_dcp").extra
