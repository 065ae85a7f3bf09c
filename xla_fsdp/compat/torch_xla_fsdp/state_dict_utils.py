"""torch_xla's ``state_dict_utils``: consolidation of sharded checkpoints, on xla_fsdp's
streaming consolidation (``xla_fsdp.checkpoint.consolidate.library``)."""
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import torch


def consolidate_sharded_state_dicts(state_dict_list: List[Dict[str, Any]],
                                    shard_metadata: Dict[str, Any]
                                    ) -> "OrderedDict[str, torch.Tensor]":
    """The unwrapped model's state dict from every rank's ``model.state_dict()`` (in rank
    order) and ``model.get_shard_metadata()`` of any rank."""
    from xla_fsdp.checkpoint.consolidate.library import consolidate_state_dicts
    return consolidate_state_dicts(state_dict_list, shard_metadata)


def consolidate_sharded_model_checkpoints(ckpt_prefix: str, ckpt_suffix: str = "*.pth",
                                          save_path: str = "", save_model: bool = True
                                          ) -> Tuple["OrderedDict[str, torch.Tensor]",
                                                     Optional[str]]:
    """``(state dict, path it was saved to or None)`` from the per-rank files matching
    ``ckpt_prefix + ckpt_suffix``, as torch_xla's. Differences: the files are read one
    tensor at a time; the output is written atomically with the optimizer state when its
    parameter mapping is known, and is never read back as an input; and files still being
    written by other ranks are waited for (up to ``xla_fsdp.checkpoint.consolidate.library.DEFAULT_WAIT_SECONDS``)
    instead of read half-written or missed."""
    from xla_fsdp.checkpoint.consolidate.library import consolidate_checkpoint_files
    return consolidate_checkpoint_files(ckpt_prefix, ckpt_suffix, save_path, save_model)
