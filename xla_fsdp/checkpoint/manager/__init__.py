"""``CheckpointManager``: periodic, asynchronous, retained checkpoints that stop cleanly on a
preemption (``manager``), over a directory of checkpoints named by step (``directory``),
the ranks' agreement at step boundaries (``step_vote``) and the SIGTERM flag
(``preemption``)."""
from .manager import CheckpointManager
from .preemption import PREEMPTED_EXIT_CODE, watch_for_preemption

__all__ = ["CheckpointManager", "PREEMPTED_EXIT_CODE", "watch_for_preemption"]
