"""``offload_optimizer=True`` takes the optimizer's state off the device, as the step program
libtpu compiles for a v5e-4 shows (XLA's compiled-program memory statistics). Parity is in
``tests/support/parity.py`` (the ``offload_*`` settings), checkpoints in
``tests/checkpoint/test_offloaded.py``."""
import collections
import functools
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import hlo, tpu_plans
from xla_fsdp.aot import compile_for_tpu

pytestmark = pytest.mark.slow  # compiles a whole offloaded step to read it


def _array_parameters(text):
    """Shapes of the step program's non-scalar parameters, with their counts."""
    return collections.Counter(i.type.split("{")[0] for i in hlo.entry(text)
                               if i.opcode == "parameter" and "[]" not in i.type
                               and not i.type.startswith("s64"))


def test_the_offloaded_step_program_holds_no_optimizer_state():
    def plan(kwargs):
        return compile_for_tpu(functools.partial(tpu_plans.ours, **kwargs), "v5e-4",
                               args=("meta",))

    with ThreadPoolExecutor(2) as pool:   # a traced process and a libtpu process each
        plain, offloaded = pool.map(plan, ({}, {"offload_optimizer": True}))
    # one program per step either way: the offloaded one runs at the end of backward, and
    # the optimizer's step on the host adds none
    assert plain.programs == offloaded.programs == 1
    # the plain step takes each float32 shard with AdamW's two moments of it; the offloaded
    # one takes only the device copy of each shard (float32 compute: as large as the shard)
    shards = _array_parameters(offloaded.hlo[0])
    assert _array_parameters(plain.hlo[0]) == collections.Counter(
        {shape: 3 * n for shape, n in shards.items()})
    assert sum(shards.values()) == len(list(tpu_plans.GPT().parameters()))
    # so the arguments are fewer by the moments' bytes: every parameter is a shard group of
    # its own, padded to a multiple of the 4 chips. The chip lays small arrays out in
    # padded tiles and the plain step also takes AdamW's scalars, hence the 1% allowance
    moments = 2 * sum(math.ceil(p.numel() / 4) * 4 for p in tpu_plans.GPT().parameters())
    saved = plain.argument_bytes - offloaded.argument_bytes
    assert moments <= saved <= 1.01 * moments, (saved, moments)
