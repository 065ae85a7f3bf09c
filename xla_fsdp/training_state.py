"""Where a unit is in a training step; hooks check it to catch misuse early."""
from enum import Enum, auto


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()
