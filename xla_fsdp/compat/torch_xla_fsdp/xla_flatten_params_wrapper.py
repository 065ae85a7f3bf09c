"""torch_xla's ``xla_flatten_params_wrapper``: a module wrapper with no FSDP state of its
own, so this is torch_xla's module itself, loaded from its file without running torch_xla's
FSDP package."""
import importlib.util
import os

import torch_xla

_NAME = "torch_xla.distributed.fsdp.xla_flatten_params_wrapper"
_spec = importlib.util.spec_from_file_location(
    _NAME, os.path.join(os.path.dirname(torch_xla.__file__), "distributed", "fsdp",
                        "xla_flatten_params_wrapper.py"))
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
