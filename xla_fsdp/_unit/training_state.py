"""Where a unit is in a training step; hooks check it to catch misuse early."""
from enum import Enum, auto


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


class TrainingStateError(RuntimeError, ValueError):
    """An FSDP call made in the wrong training state. A ValueError too, as torch_xla's
    ``assert_state`` raises, so code written against it catches this one."""
