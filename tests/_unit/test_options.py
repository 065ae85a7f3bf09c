"""The constructor's arguments to options: the hardware-dependent defaults (see [Note:
defaults that depend on the hardware]). No XLA: the ranks and the hardware are stubbed."""
import inspect

import pytest

from xla_fsdp import FSDP
from xla_fsdp._unit import options as options_module
from xla_fsdp._unit.options import FsdpOptions

NOT_OPTIONS = ("self", "module", "auto_wrap_policy", "auto_wrapper_callable")


def resolve(monkeypatch, hardware, **arguments):
    monkeypatch.setattr(options_module, "device_type", lambda: hardware)
    monkeypatch.setattr(options_module, "_resolve_ranks", lambda *_: (0, 2))  # no runtime
    kw = {name: p.default for name, p in inspect.signature(FSDP.__init__).parameters.items()
          if name not in NOT_OPTIONS}
    kw.update(arguments)
    return FsdpOptions.from_arguments(kw)


@pytest.mark.parametrize("hardware, dim0", [("TPU", True), ("CPU", False), (None, False),
                                            ("NEURON", False), ("CUDA", False)])
def test_unset_layout_options_take_the_hardware_default(monkeypatch, hardware, dim0):
    opts = resolve(monkeypatch, hardware)
    assert (opts.shard_param_on_dim_0, opts.coalesce_all_gather_ops) == (dim0, dim0)
    # an auto-wrapped child is built from the resolved values, wherever it is built
    rebuilt = resolve(monkeypatch, "CPU" if dim0 else "TPU", **{
        k: v for k, v in opts.as_arguments().items() if k not in NOT_OPTIONS})
    assert rebuilt == opts


def test_what_the_user_says_wins_over_the_hardware(monkeypatch):
    flat = resolve(monkeypatch, "TPU", shard_param_on_dim_0=False, coalesce_all_gather_ops=False)
    assert (flat.shard_param_on_dim_0, flat.coalesce_all_gather_ops) == (False, False)
    mixed = resolve(monkeypatch, "TPU", coalesce_all_gather_ops=False)
    assert (mixed.shard_param_on_dim_0, mixed.coalesce_all_gather_ops) == (True, False)
    dim0 = resolve(monkeypatch, "CPU", shard_param_on_dim_0=True)
    assert (dim0.shard_param_on_dim_0, dim0.coalesce_all_gather_ops) == (True, False)
    # torch_xla's alias for AWS Neuron still turns dim-0 shards on
    assert resolve(monkeypatch, "NEURON", on_neuron=True).shard_param_on_dim_0
