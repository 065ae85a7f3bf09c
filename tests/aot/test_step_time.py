"""The step-time model on hand-written scheduled HLO: per-instruction rooflines, precision
passes, what a fusion reads, and collectives timed by the torus axes their rank groups
span (a 2x4 slice has no wraparound links, a 16x16 pod has them on both axes)."""
import pytest

from xla_fsdp.aot.step_time import CALIBRATED, Efficiency, collective_seconds, estimate
from xla_fsdp.aot.topology import resolve

PEAKS = Efficiency()     # the mechanics, at the published rates

V5E = dict(peak=197e12, hbm=819e9, link=4.5e10)   # published peak, HBM; scaling book's link

MATMUL = """HloModule step, is_scheduled=true

%fused_mm (p0: bf16[1024,4096], p1: bf16[4096,4096]) -> bf16[1024,4096] {
  %p0 = bf16[1024,4096]{1,0} parameter(0)
  %p1 = bf16[4096,4096]{1,0} parameter(1)
  ROOT %conv = bf16[1024,4096]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
}

ENTRY %main (a: bf16[1024,4096], w: bf16[4096,4096], s: bf16[SHARD]) -> (bf16[1024,4096], bf16[FULL]) {
  %a = bf16[1024,4096]{1,0} parameter(0)
  %w = bf16[4096,4096]{1,0} parameter(1)
  %s = bf16[SHARD]{0} parameter(2)
  START
  %mm = bf16[1024,4096]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_mm
  DONE
  ROOT %t = (bf16[1024,4096]{1,0}, bf16[FULL]{0}) tuple(%mm, %ag)
}
"""
ASYNC = ("%ags = (bf16[SHARD]{0}, bf16[FULL]{0}) all-gather-start(%s), replica_groups={}, "
         "dimensions={0}", "%ag = bf16[FULL]{0} all-gather-done(%ags)")
SYNC = ("%ag = bf16[FULL]{0} all-gather(%s), replica_groups={}, dimensions={0}", "")

MM_SECONDS = 2 * 1024 * 4096 * 4096 / V5E["peak"]          # matmul-bound: 174 us


def _program(full_elements, chips, schedule):
    start, done = schedule
    return (MATMUL.replace("START", start).replace("DONE", done)
            .replace("SHARD", str(full_elements // chips)).replace("FULL", str(full_elements)))


def _gather_seconds(full_bytes, chips, bandwidth):
    return (chips - 1) / chips * full_bytes / bandwidth


@pytest.mark.parametrize("topology, bandwidth", [
    ("v5e:2x4", 2 * V5E["link"]),       # two axes, no wraparound: one way on each
    ("v5e:16x16", 4 * V5E["link"]),     # two rings: both ways on each axis
])
def test_a_gather_overlapped_with_a_matmul_costs_only_what_the_matmul_does_not_hide(
        topology, bandwidth):
    slice_ = resolve(topology)
    elements = 32 * 2 ** 20                       # 64 MiB gathered, bf16
    gather = _gather_seconds(2 * elements, slice_.chips, bandwidth)
    overlapped = estimate(_program(elements, slice_.chips, ASYNC), slice_, PEAKS)
    assert overlapped.busy_seconds == pytest.approx(MM_SECONDS)
    assert overlapped.collective_seconds == pytest.approx(gather)
    assert gather > MM_SECONDS
    assert overlapped.seconds == pytest.approx(gather)
    assert overlapped.exposed_collective_seconds == pytest.approx(gather - MM_SECONDS)
    synchronous = estimate(_program(elements, slice_.chips, SYNC), slice_, PEAKS)
    assert synchronous.seconds == pytest.approx(MM_SECONDS + gather)
    small = estimate(_program(2 ** 20, slice_.chips, ASYNC), slice_, PEAKS)    # 2 MiB: hidden
    assert small.seconds == pytest.approx(MM_SECONDS)
    assert small.exposed_collective_seconds == 0


def test_the_wraparound_follows_the_slice_and_the_group():
    pod, eight = resolve("v5e:16x16"), resolve("v5e:2x4")
    row = [(x, 0) for x in range(16)]              # one full axis of the pod: a ring
    half_row = [(x, 0) for x in range(8)]          # half of it: a line
    mb = 2 ** 20 * 64
    assert collective_seconds("all-gather", mb, row, pod, PEAKS) == \
        pytest.approx(15 / 16 * mb / (2 * V5E["link"]))
    assert collective_seconds("all-gather", mb, half_row, pod) == \
        pytest.approx(7 / 8 * mb / V5E["link"])
    # a reduce-scatter moves its operand (n results), an all-reduce twice its result
    everyone = [eight.coords(i) for i in range(8)]
    assert collective_seconds("reduce-scatter", mb / 8, everyone, eight) == \
        pytest.approx(collective_seconds("all-gather", mb, everyone, eight))
    assert collective_seconds("all-reduce", mb, everyone, eight) == \
        pytest.approx(2 * 7 / 8 * mb / (2 * V5E["link"]))
    # an all-to-all of n results a quarter of the all-gather of them (the scaling book)
    assert collective_seconds("all-to-all", mb / 8, everyone, eight) == \
        pytest.approx(collective_seconds("all-gather", mb, everyone, eight) / 4)
    # tiny transfers are bound by the hops of the longest path, a microsecond each
    assert collective_seconds("all-gather", 64, everyone, eight) == pytest.approx(4e-6)
    assert collective_seconds("all-gather", 64, row, pod) == pytest.approx(8e-6)
    # v5p: wraparounds on every axis of whole cubes, none below a cube
    cube, small = resolve("v5p:4x4x4"), resolve("v5p:2x2x2")
    assert cube.wraparound(0) and cube.wraparound(2) and not small.wraparound(0)
    assert resolve("v6e:8x16").wraparound(1) and not resolve("v6e:8x16").wraparound(0)


PRECISION = """HloModule step, is_scheduled=true

ENTRY %main (a: f32[1024,4096], w: f32[4096,4096]) -> f32[1024,4096] {
  %a = f32[1024,4096]{1,0} parameter(0)
  %w = f32[4096,4096]{1,0} parameter(1)
  ROOT %c = f32[1024,4096]{1,0} convolution(%a, %w), dim_labels=bf_io->bfPRECISION
}
"""


@pytest.mark.parametrize("precision, passes", [("", 1), (", operand_precision={high,high}", 3),
                                               (", operand_precision={highest,highest}", 6)])
def test_float32_matmuls_take_the_passes_their_precision_asks(precision, passes):
    e = estimate(PRECISION.replace("PRECISION", precision), resolve("v5e-1"), PEAKS)
    flops = 2 * 1024 * 4096 * 4096
    assert e.dot_flops == flops and e.mxu_flops == passes * flops
    assert e.multipass_flops == (flops if passes > 1 else 0)
    assert e.seconds == pytest.approx(passes * flops / V5E["peak"])


LOOP = """HloModule step, is_scheduled=true

%fused_slice (p0: f32[32,4096,4096], p1: s32[]) -> f32[4096,4096] {
  %p0 = f32[32,4096,4096]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,4096,4096]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,4096,4096}
  ROOT %r = f32[4096,4096]{1,0} bitcast(%ds)
}

%body (p: (s32[], f32[32,4096,4096])) -> (s32[], f32[32,4096,4096]) {
  %p = (s32[], f32[32,4096,4096]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = f32[32,4096,4096]{2,1,0} get-tuple-element(%p), index=1
  %layer = f32[4096,4096]{1,0} fusion(%stack, %i), kind=kLoop, calls=%fused_slice
  ROOT %t = (s32[], f32[32,4096,4096]{2,1,0}) tuple(%i, %stack)
}

%cond (p: (s32[], f32[32,4096,4096])) -> pred[] {
  %p = (s32[], f32[32,4096,4096]{2,1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (p: (s32[], f32[32,4096,4096])) -> (s32[], f32[32,4096,4096]) {
  %p = (s32[], f32[32,4096,4096]{2,1,0}) parameter(0)
  ROOT %w = (s32[], f32[32,4096,4096]{2,1,0}) while(%p), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"32"}}
}
"""


def test_a_loop_runs_its_trips_and_a_fusion_reads_only_the_slice_it_takes():
    e = estimate(LOOP, resolve("v5e-1"), PEAKS)
    layer = 4096 * 4096 * 4                                   # read once, written once
    assert e.hbm_bytes == pytest.approx(32 * 2 * layer)
    assert e.seconds == pytest.approx(32 * 2 * layer / V5E["hbm"])
    slower = estimate(LOOP, resolve("v5e-1"), Efficiency(memory=0.5))
    assert slower.seconds == pytest.approx(2 * e.seconds)


# libtpu prefetches a weight into on-chip memory (S(1)) in four row blocks by asynchronous
# slices, DMAs whose starts hold ((operand), result, context), as in our 1B step's schedule
SLICES = """HloModule step, is_scheduled=true

ENTRY %main (w: f32[1024,2048]) -> (f32[256,2048], f32[256,2048], f32[256,2048], f32[256,2048]) {
  %w = f32[1024,2048]{1,0:T(8,128)} parameter(0)
  STARTS
  DONES
  ROOT %t = (f32[256,2048]{1,0:T(8,128)S(1)}, f32[256,2048]{1,0:T(8,128)S(1)}, f32[256,2048]{1,0:T(8,128)S(1)}, f32[256,2048]{1,0:T(8,128)S(1)}) tuple(%d0, %d1, %d2, %d3)
}
"""


def test_an_asynchronous_slice_reads_its_slice_of_hbm_once():
    starts = "\n".join(
        f"  %s{i} = ((f32[1024,2048]{{1,0:T(8,128)}}), f32[256,2048]{{1,0:T(8,128)S(1)}}, "
        f"s32[]{{:S(2)}}) slice-start(%w), slice={{[{256 * i}:{256 * (i + 1)}], [0:2048]}}"
        for i in range(4))
    dones = "\n".join(f"  %d{i} = f32[256,2048]{{1,0:T(8,128)S(1)}} slice-done(%s{i})"
                       for i in range(4))
    e = estimate(SLICES.replace("STARTS", starts).replace("DONES", dones), resolve("v5e-1"),
                 PEAKS)
    weight = 1024 * 2048 * 4   # read out of HBM once, in four slices; written to VMEM
    assert e.hbm_bytes == pytest.approx(weight)
    assert e.seconds == pytest.approx(weight / V5E["hbm"])


def test_the_default_rates_are_the_calibrated_ones():
    """The fitted fractions of the peaks (scripts.bench.tpu_calibration) slow the estimate
    of a matmul-bound instruction by the matmul fraction."""
    assert 0 < CALIBRATED.matmul < 1 and 0 < CALIBRATED.memory <= 1
    at_peaks = estimate(PRECISION.replace("PRECISION", ""), resolve("v5e-1"), PEAKS)
    calibrated = estimate(PRECISION.replace("PRECISION", ""), resolve("v5e-1"))
    assert calibrated.seconds == pytest.approx(at_peaks.seconds / CALIBRATED.matmul)
