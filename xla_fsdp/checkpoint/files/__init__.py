"""Checkpoint files: lazy reading with CRC checks, streaming writing, atomic replacement.
Pure PyTorch; no XLA."""
from .atomic import atomic_path
from .reader import CheckpointError, CheckpointFile, TensorRef
from .writer import SafetensorsWriter, TensorStub, TorchFileWriter

__all__ = ["atomic_path", "CheckpointError", "CheckpointFile", "TensorRef", "SafetensorsWriter",
           "TensorStub", "TorchFileWriter"]
