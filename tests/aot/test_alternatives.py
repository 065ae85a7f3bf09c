"""What would fit (see [Note: what would fit]): the order the switches are tried in, a switch
already on skipped uncompiled, the budget, the host's memory, a script without our units
offered more chips only; and, against libtpu, a model whose answer is known."""
import pytest

from tests.support import tpu_plans
from xla_fsdp.aot.alternatives import search
from xla_fsdp.aot.report import HostMemory, TpuReport
from xla_fsdp.aot.topology import resolve
from xla_fsdp.aot.traced.process import TracedStep
from xla_fsdp.aot.traced.step_graphs import Graph
from xla_fsdp.aot.traced.switches import Switches
from ..support.checks import every

GIB = 2 ** 30


def _traced(fingerprint, units=3):
    return TracedStep([Graph("", fingerprint, 1, 1)], 3, True, 0, False, False,
                      fsdp_units=units)


class _Fake:
    """A step that fits only with its optimizer offloaded, or on 4 chips; bf16 compute is
    on already (its program is the step's own)."""

    def __init__(self, host_fits=True):
        self.traced, self.compiled, self.host_fits = [], [], host_fits

    def trace(self, fn, args, chips, max_graphs, switches):
        self.traced.append((switches, chips))
        same = Switches(bf16_compute=True, activation_checkpointing=switches.activation_checkpointing,
                        offload_optimizer=switches.offload_optimizer,
                        batch_divisor=switches.batch_divisor)
        return _traced(f"{same}@{chips}")

    def report(self, traced, slice_):
        self.compiled.append(traced.graphs[0].fingerprint)
        fits = "offload" in traced.graphs[0].fingerprint or slice_.chips >= 4
        host = HostMemory("vm", 1, 48 * 10 ** 9, 20 * 10 ** 9 if self.host_fits else 60 * 10 ** 9,
                          "src") if "offload" in traced.graphs[0].fingerprint else None
        return TpuReport(slice_, fits, 16 * GIB, 15 * GIB, 10 * GIB if fits else 0, 0, 0, 0, 0,
                         0.0, 0.0, [], required_bytes=0 if fits else 18 * GIB,
                         host_memory=host)


def test_switches_are_tried_cheapest_first_and_the_search_stops_at_what_fits():
    fake, slice_ = _Fake(), resolve("v5e-1")
    step = fake.trace(None, (), 1, 12, Switches())
    found = search(None, (), slice_, step, fake.trace, fake.report, wanted=1)
    # bf16 alone traces the step's own program, checkpointing with bf16 the program of
    # checkpointing alone: neither is compiled again nor reported
    assert [a.description for a in found] == ["activation checkpointing per unit",
                                              "offload_optimizer=True"]
    assert [a.fits for a in found] == [False, True]
    assert len(fake.compiled) == 2 and found[-1].peak_bytes == 10 * GIB
    assert found[0].required_bytes == 18 * GIB


def test_the_budget_the_host_and_a_script_without_our_units():
    fake = _Fake(host_fits=False)
    step = fake.trace(None, (), 1, 12, Switches())
    found = search(None, (), resolve("v5e-1"), step, fake.trace, fake.report, wanted=1,
                   budget=20)
    offloaded = [a for a in found if "offload" in a.description]
    assert offloaded and not any(a.fits for a in offloaded)
    assert every("host memory" in a.description for a in offloaded)
    assert found[-1].topology == "v5e-4" and found[-1].fits      # then more chips
    budgeted = search(None, (), resolve("v5e-1"), step, _Fake().trace, _Fake().report,
                      wanted=1, budget=2)
    assert len(budgeted) == 2
    fake = _Fake()
    plain = _traced("fsdpv2", units=0)
    found = search(None, (), resolve("v5e-1"), plain, fake.trace, fake.report, wanted=1)
    assert [(a.topology, a.fits) for a in found] == [("v5e-4", True)]
    assert [chips for _, chips in fake.traced] == [4]


@pytest.mark.slow
def test_a_model_too_big_for_a_chip_is_told_to_offload_its_optimizer_and_that_fits():
    """1.2e9 parameters with AdamW need about 18.6 GiB on a v5e chip: checkpointing and bf16
    compute do not change that, offloading the optimizer does; the configuration named
    compiles and fits when the script asks for it itself."""
    from xla_fsdp.aot import compile_for_tpu
    report = compile_for_tpu(tpu_plans.too_big_for_one_chip, "v5e-1", alternatives=1)
    assert not report.fits and report.required_bytes > 16 * GIB
    assert [(a.description, a.fits) for a in report.alternatives] == [
        ("activation checkpointing per unit", False), ("compute_dtype=torch.bfloat16", False),
        ("activation checkpointing per unit, compute_dtype=torch.bfloat16", False),
        ("offload_optimizer=True", True)]
    named = report.alternatives[-1]
    assert named.step_seconds > 0 and 0 < named.peak_bytes < report.usable_hbm_bytes
    asked = compile_for_tpu(tpu_plans.too_big_for_one_chip, "v5e-1", args=(True,))
    assert asked.fits and asked.peak_bytes == named.peak_bytes
    assert asked.host_memory is not None and asked.host_memory.fits
    assert asked.host_memory.vm == "ct5lp-hightpu-1t"
    assert asked.host_memory.state_bytes >= 16 * tpu_plans.WIDE[0] ** 2 * tpu_plans.WIDE[1]
