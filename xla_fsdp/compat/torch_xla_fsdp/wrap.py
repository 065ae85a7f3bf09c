"""torch_xla's ``wrap`` module: the auto-wrap policies and ``recursive_wrap``."""
from xla_fsdp.wrap import (always_wrap_policy, lambda_auto_wrap_policy, recursive_wrap,
                           size_based_auto_wrap_policy, transformer_auto_wrap_policy)

__all__ = ["always_wrap_policy", "lambda_auto_wrap_policy", "recursive_wrap",
           "size_based_auto_wrap_policy", "transformer_auto_wrap_policy"]
