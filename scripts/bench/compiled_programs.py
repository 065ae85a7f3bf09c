"""The programs torch_xla's ``torch.compile`` bridge compiles: each region's HLO, as the
bridge hands it to XLA, so that a compiled step can be compiled again by libtpu
(``benchmarks/compiled_tpu.py``) and a test can read them. A traced process
(``xla_fsdp/aot/traced/process.py``) cannot plan such a step: the bridge runs its programs,
which a traced process never does. It swaps a private torch_xla binding for the block, so it
lives with the benchmarks and tests that use it, not in the package."""
from __future__ import annotations

import contextlib
from typing import Iterator, List

from xla_fsdp._xla.private_api import graph_hlo


@contextlib.contextmanager
def compiled_programs() -> Iterator[List[str]]:
    """Within the block, the HLO text of every distinct program the bridge compiles, in the
    order compiled (a torch.compile'd step's forward, then its backward). On virtual devices
    every rank compiles its own Dynamo graphs to the same programs: each is kept once."""
    import torch_xla
    xlac = torch_xla._XLAC
    warm_up = xlac._xla_warm_up_cache
    programs: List[str] = []

    def recording(tensors, devices):
        text = graph_hlo(tensors)
        if text not in programs:
            programs.append(text)
        return warm_up(tensors, devices)

    xlac._xla_warm_up_cache = recording
    try:
        yield programs
    finally:
        xlac._xla_warm_up_cache = warm_up
