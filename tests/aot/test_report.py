"""The report: its table, the step-time estimate and the utilizations, and a step that does
not fit."""
import pytest

from xla_fsdp.aot.report import Alternative, HostMemory, TpuReport
from xla_fsdp.aot.step_time import StepTime
from xla_fsdp.aot.topology import resolve
from xla_fsdp.aot.tpu_schedule import Collective
from ..support.checks import every

GIB = 2 ** 30


def _report(**kw):
    values = dict(topology=resolve("v5e-8"), fits=True, hbm_bytes=16 * GIB,
                  usable_hbm_bytes=int(15.75 * GIB), peak_bytes=3 * GIB,
                  argument_bytes=GIB, output_bytes=GIB, alias_bytes=GIB, temp_bytes=2 * GIB,
                  flops=197e12 * 0.010, bytes_accessed=819e9 * 0.004,
                  collectives=[Collective("all-gather", "all-gather.1", 400e9 * 0.002, 1,
                                          "all-gather", True, True, 3),
                               Collective("reduce-scatter", "reduce-scatter.2", 400e9 * 0.001,
                                          1, "all-reduce", False, False, 0)],
                  estimate=StepTime(seconds=0.020, busy_seconds=0.015, matmul_seconds=0.012,
                                    memory_seconds=0.006, collective_seconds=0.008,
                                    exposed_collective_seconds=0.005,
                                    mxu_flops=197e12 * 0.010, dot_flops=197e12 * 0.010),
                  model_flops=197e12 * 0.006)
    values.update(kw)
    return TpuReport(**values)


def test_mfu_counts_model_flops_and_hfu_what_the_hardware_runs():
    report = _report()
    assert report.step_seconds == 0.020
    assert report.mfu == pytest.approx(0.006 / 0.020)
    assert report.hfu == pytest.approx(0.010 / 0.020)
    text = str(report)
    for expected in ("v5e-8 (v5e:2x4, 8 chips): fits", "peak per chip", "3.00 GiB",
                     "15.75 GiB", "20.00 ms", "waiting for collectives", "5.00 ms",
                     "| all-gather", "| reduce-scatter", "MFU (model FLOPs)", "30.0%",
                     "HFU", "50.0%", "not a measurement", "scaling-book"):
        assert expected in text, expected
    summary = report.collective_summary()
    assert summary["all-gather"]["overlapped"] == 1 and summary["reduce-scatter"]["overlapped"] == 0


def test_a_step_that_does_not_fit_shows_the_compilers_figures_and_what_would():
    message = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
               "memory required for HLO temporaries (25.60G) exceeds available HBM (15.75G).")
    report = _report(fits=False, peak_bytes=0, argument_bytes=0, output_bytes=0,
                     alias_bytes=0, temp_bytes=0, flops=0.0, bytes_accessed=0.0,
                     collectives=[], message=message, required_bytes=int(25.6 * GIB),
                     estimate=None, model_flops=0.0,
                     alternatives=[Alternative("activation checkpointing", False, 0,
                                               int(17.2 * GIB), None, "v5e-8"),
                                   Alternative("offload_optimizer", True, int(9.5 * GIB), 0,
                                               0.31, "v5e-8")])
    text = str(report)
    assert "DOES NOT FIT" in text and "25.60 GiB" in text and "CompileTimeHbmOom" in text
    assert report.mfu is None and "Step-time estimate" not in text
    assert "What would fit" in text and "needs 17.20 GiB" in text and "9.50 GiB" in text
    assert "310.00 ms" in text


def test_host_memory_of_an_offloaded_optimizer_is_checked_against_the_vm():
    vm = resolve("v5e-8").host_vm()
    assert (vm.machine_type, vm.chips, vm.memory_bytes) == ("ct5lp-hightpu-8t", 8, 384e9)
    over = HostMemory(vm.machine_type, 8, vm.memory_bytes, int(96e9 * 5), vm.source)
    assert not over.fits and "DOES NOT FIT" in str(_report(host_memory=over))
    assert HostMemory(vm.machine_type, 8, vm.memory_bytes, int(96e9), vm.source).fits


def test_the_memory_table_puts_the_peak_first_in_one_unit_with_parts_that_add_up():
    mib = 2 ** 20
    text = str(_report(peak_bytes=int(4.42 * mib), argument_bytes=3 * mib, output_bytes=mib,
                       alias_bytes=mib, temp_bytes=int(7.54 * mib), bytes_accessed=GIB))
    rows = [line for line in text.splitlines()[1:] if line.startswith("| ")]
    assert rows[0].split("|")[1].strip() == "peak per chip"
    memory = rows[:rows.index(next(r for r in rows if "FLOPs per chip" in r))]
    # MiB, since some figures would read 0.00 GiB; the limits then read 16128.00 MiB
    assert every(r.rstrip(" |").endswith("MiB") for r in memory), memory
    values = {r.split("|")[1].strip(): float(r.split("|")[2].split()[0]) for r in memory}
    parts = ["  arguments", "  outputs", "  less outputs aliased in donated arguments",
             "  temporaries"]
    total = values["allocated in all (not all live at once)"]
    assert sum(values[p.strip()] for p in parts) == pytest.approx(total, abs=0.02)
