"""Checkpoint files: lazy reading with CRC checks, streaming writing, atomic replacement,
and errors that name the file when a disk fills. Pure PyTorch; no XLA."""
from .atomic import (StagedFile, atomic_path, atomic_paths, is_out_of_space, no_space_error,
                     remove_if_there)
from .reader import CheckpointError, CheckpointFile, TensorRef
from .safetensors_reader import SafetensorsFile
from .writer import SafetensorsWriter, TorchFileWriter

__all__ = ["atomic_path", "atomic_paths", "StagedFile", "is_out_of_space", "no_space_error",
           "remove_if_there", "CheckpointError", "CheckpointFile", "TensorRef", "SafetensorsFile",
           "SafetensorsWriter", "TorchFileWriter"]
