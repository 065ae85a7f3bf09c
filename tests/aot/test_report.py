"""The report: its table, the roofline estimate from the chip's published rates, and a step
that does not fit."""
import pytest

from xla_fsdp.aot.report import TpuReport
from xla_fsdp.aot.topology import resolve
from xla_fsdp.aot.tpu_schedule import Collective

GIB = 2 ** 30


def _report(**kw):
    values = dict(topology=resolve("v5e-8"), fits=True, hbm_bytes=16 * GIB,
                  usable_hbm_bytes=int(15.75 * GIB), peak_bytes=3 * GIB,
                  argument_bytes=GIB, output_bytes=GIB, alias_bytes=GIB, temp_bytes=2 * GIB,
                  flops=197e12 * 0.010, bytes_accessed=819e9 * 0.004,
                  collectives=[Collective("all-gather", "all-gather.1", 400e9 * 0.002, 1,
                                          "all-gather", True, True, 3),
                               Collective("reduce-scatter", "reduce-scatter.2", 400e9 * 0.001,
                                          1, "all-reduce", False, False, 0)])
    values.update(kw)
    return TpuReport(**values)


def test_roofline_hides_only_the_collectives_the_schedule_overlaps():
    roof = _report().roofline()
    assert roof.compute_seconds == pytest.approx(0.010)
    assert roof.memory_seconds == pytest.approx(0.004)
    assert roof.collective_seconds == pytest.approx(0.003)
    assert roof.exposed_collective_seconds == pytest.approx(0.001)
    assert roof.step_seconds == pytest.approx(0.011)
    assert roof.mfu == pytest.approx(0.010 / 0.011)


def test_the_table_states_the_figures_and_where_the_chip_figures_come_from():
    text = str(_report())
    for expected in ("v5e-8 (v5e:2x4, 8 chips): fits", "peak per chip", "3.000 GiB",
                     "15.750 GiB", "https://cloud.google.com/tpu/docs/v5e", "11.00 ms",
                     "| all-gather", "| reduce-scatter", "90.9%", "not a measurement"):
        assert expected in text, expected
    summary = _report().collective_summary()
    assert summary["all-gather"]["overlapped"] == 1 and summary["reduce-scatter"]["overlapped"] == 0


def test_a_step_that_does_not_fit_shows_the_compilers_figures_and_message():
    message = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
               "memory required for HLO temporaries (25.60G) exceeds available HBM (15.75G).")
    report = _report(fits=False, peak_bytes=0, argument_bytes=0, output_bytes=0,
                     alias_bytes=0, temp_bytes=0, flops=0.0, bytes_accessed=0.0,
                     collectives=[], message=message, required_bytes=int(25.6 * GIB))
    text = str(report)
    assert "DOES NOT FIT" in text and "25.600 GiB" in text and "CompileTimeHbmOom" in text
    assert report.roofline() is None and "Roofline" not in text
