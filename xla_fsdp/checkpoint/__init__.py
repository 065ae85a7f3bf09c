"""Checkpoints of an FSDP model: per-rank files (``save_sharded``/``load_sharded``, in
torch_xla's format with a record of ours), DCP checkpoints that PyTorch FSDP2 and torchtitan
read and write (``save_dcp``/``load_dcp``), consolidated checkpoints written from training
code with no shared filesystem and loaded back in any of their formats
(``save_consolidated``/``load_consolidated``), the unwrapped model's full state dict, asynchronous
saves (``async_save=True``, ``async_save``), and ``CheckpointManager`` (periodic, retained
checkpoints that stop cleanly on a preemption: ``manager``).

Laid out by the path data takes. The API, one module per format: ``sharded``, ``dcp``,
``consolidated``, ``full_state_dict`` (the two per-rank saves are defined with their
writers, ``writers.per_rank_files`` and ``writers.dcp_shards``, and exported there). A load: a source (``sources``) -> the one staging
loader (``staging``), which checks everything and reads it all before the ranks agree
(``coordination``) -> the live model; one shortcut: a resume at the same world size and
wrapping, where each rank loads its own per-rank file whole (``sharded``) and commits as
the staging loader does. A save: the live model -> a writer (``writers``): each
rank's own per-rank file or DCP chunks, or one consolidated output streamed from an
``unwrapped_state``, gathered from the live model (``gathered_state``) or read from per-rank
files (``per_rank``). Under them: the formats (``formats``: their keys, the per-rank
shard metadata, consolidated names, DCP's layout), the optimizer state's one rule and walk (``optimizer_state``), what they
need of a wrapped model (``unit_protocol``, ``live_model``), and the files' bytes
(``files``). The offline ``consolidate_sharded_ckpts`` tool (``consolidate``) imports these;
nothing here imports it."""
from .async_save import PendingSave
from .consolidated import load_consolidated, save_consolidated
from .dcp import load_dcp, save_dcp
from .files import CheckpointError
from .manager import PREEMPTED_EXIT_CODE, CheckpointManager, watch_for_preemption
from .formats.per_rank import sharded_checkpoint_path
from .sharded import load_sharded, save_sharded

__all__ = ["save_sharded", "load_sharded", "save_dcp", "load_dcp", "save_consolidated",
           "load_consolidated",
           "sharded_checkpoint_path", "CheckpointManager", "PendingSave",
           "PREEMPTED_EXIT_CODE", "watch_for_preemption", "CheckpointError"]
