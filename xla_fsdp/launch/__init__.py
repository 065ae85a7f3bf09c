"""``launch(fn)``: run ``fn(rank, *args)`` once per XLA device, on an accelerator through
torch_xla's own runner, elsewhere on N virtual CPU devices in one process (``virtual``)."""
from .runner import DEFAULT_VIRTUAL_DEVICES, NUM_DEVICES_ENV, LaunchError, accelerator_type, launch

__all__ = ["launch", "LaunchError", "accelerator_type", "DEFAULT_VIRTUAL_DEVICES",
           "NUM_DEVICES_ENV"]
