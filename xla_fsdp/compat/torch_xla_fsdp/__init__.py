"""``torch_xla.distributed.fsdp`` as torch_xla 2.9 lays it out, module by module, backed by
xla_fsdp. ``xla_fsdp.patch_torch_xla()`` installs these modules under torch_xla's names, so
code that imports torch_xla's FSDP itself (Hugging Face Trainer, Lightning Fabric, scripts
written from torch_xla's documentation) runs on xla_fsdp unchanged.

Same names, signatures, defaults and return values as torch_xla 2.9; where behaviour differs
it is a fix, listed on ``XlaFullyShardedDataParallel``. ``tests/compat`` compares
this surface with the installed torch_xla's at run time.
"""
from xla_fsdp.fully_sharded import XlaFullyShardedDataParallel

from .state_dict_utils import consolidate_sharded_model_checkpoints, consolidate_sharded_state_dicts
from .utils import checkpoint_module

__all__ = [
    "XlaFullyShardedDataParallel",
    "consolidate_sharded_state_dicts",
    "consolidate_sharded_model_checkpoints",
    "checkpoint_module",
]
