"""Fully Sharded Data Parallel (ZeRO-3) for PyTorch on XLA devices."""
from .launch import LaunchError, launch

__all__ = ["launch", "LaunchError"]
