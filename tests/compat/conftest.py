import sys

import pytest


@pytest.fixture
def patched_here():
    """patch_torch_xla() in the test process, undone afterwards: other tests launch
    torch_xla's own FSDP, and the plain Trainer must not see ACCELERATE_USE_FSDP."""
    from xla_fsdp import patch_torch_xla
    from xla_fsdp.compat.patch import ENV
    from xla_fsdp.launch.environment import restored_environment
    names = [n for n in sys.modules if n.startswith("torch_xla.distributed.fsdp")]
    saved_modules = {n: sys.modules[n] for n in names}
    import torch_xla.distributed
    saved_attr = torch_xla.distributed.__dict__.get("fsdp")
    with restored_environment([ENV, "ACCELERATE_USE_FSDP"]):
        patch_torch_xla()
        yield
    for n in [n for n in sys.modules if n.startswith("torch_xla.distributed.fsdp")]:
        del sys.modules[n]
    sys.modules.update(saved_modules)
    if saved_attr is None:
        torch_xla.distributed.__dict__.pop("fsdp", None)
    else:
        torch_xla.distributed.fsdp = saved_attr
