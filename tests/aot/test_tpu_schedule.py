"""Reading libtpu's optimized, scheduled HLO: which collectives run asynchronously and which
overlap compute, what each moves per chip. Synthetic modules in libtpu's own forms."""
import pytest

from xla_fsdp.aot.tpu_schedule import (array_bytes, bytes_sent_per_chip, collectives, span,
                                       parse_module, traced_collectives)

OPTIMIZED = """HloModule step, is_scheduled=true

%add.clone (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0), metadata={op_name="reduce-scatter.77"}
  %y = f32[] parameter(1), metadata={op_name="reduce-scatter.77"}
  ROOT %a = f32[] add(%x, %y)
}

%fused_start (param_0.1: f32[1024]) -> (f32[1024], f32[8192]) {
  %param_0.1 = f32[1024]{0} parameter(0)
  %all-gather.5 = f32[8192]{0} all-gather(%param_0.1), replica_groups={}, dimensions={0}, metadata={op_name="all-gather.10"}
  ROOT %t = (f32[1024]{0}, f32[8192]{0}) tuple(%param_0.1, %all-gather.5)
}

%async_collective_fusion.1 (param_0.2: f32[1024], param_1.2: f32[8192], param_2.2: f32[64,128]) -> (f32[64,128], f32[8192]) {
  %param_0.2 = f32[1024]{0} parameter(0)
  %param_1.2 = f32[8192]{0} parameter(1)
  %param_2.2 = f32[64,128]{1,0} parameter(2)
  %all-gather.6 = f32[8192]{0} all-gather(%param_0.2), replica_groups={}, dimensions={0}, metadata={op_name="all-gather.10"}
  %convolution.3 = f32[64,128]{1,0} convolution(%param_2.2, %param_2.2), dim_labels=bf_io->bf
  ROOT %t2 = (f32[64,128]{1,0}, f32[8192]{0}) tuple(%convolution.3, %all-gather.6)
}

%fused_done (param_0.3: f32[8192]) -> f32[8192] {
  %param_0.3 = f32[8192]{0} parameter(0)
  ROOT %all-gather.7 = f32[8192]{0} all-gather(%param_0.3), replica_groups={}, dimensions={0}, metadata={op_name="all-gather.10"}
}

%fused_compute (param_0.4: f32[64,128]) -> f32[64,128] {
  %param_0.4 = f32[64,128]{1,0} parameter(0)
  ROOT %m = f32[64,128]{1,0} multiply(%param_0.4, %param_0.4)
}

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %g = f32[256]{0} get-tuple-element(%p), index=1
  %ag.9 = f32[2048]{0} all-gather(%g), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, metadata={op_name="all-gather.99"}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %r = (s32[], f32[256]{0}) tuple(%i, %g)
}

%cond (p: (s32[], f32[256])) -> pred[] {
  %p = (s32[], f32[256]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (p0: f32[1024], p1: f32[64,128], p2: f32[65536], p3: (s32[], f32[256])) -> f32[64,128] {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[64,128]{1,0} parameter(1)
  %p2 = f32[65536]{0} parameter(2)
  %p3 = (s32[], f32[256]{0}) parameter(3)
  %async-collective-start = (f32[1024]{0}, f32[8192]{0}) fusion(%p0), kind=kCustom, calls=%fused_start
  %gte = f32[8192]{0} get-tuple-element(%async-collective-start), index=1
  %fusion.1 = (f32[64,128]{1,0}, f32[8192]{0}) fusion(%p0, %gte, %p1), kind=kCustom, calls=%async_collective_fusion.1
  %fusion.2 = f32[64,128]{1,0} fusion(%p1), kind=kLoop, calls=%fused_compute
  %gte2 = f32[8192]{0} get-tuple-element(%fusion.1), index=1
  %async-collective-done = f32[8192]{0} fusion(%gte2), kind=kCustom, calls=%fused_done
  %all-reduce.3 = f32[65536]{0} all-reduce(%p2), replica_groups={}, to_apply=%add.clone
  %ds = f32[8192]{0} dynamic-slice(%all-reduce.3, %c0), dynamic_slice_sizes={8192}
  %while.1 = (s32[], f32[256]{0}) while(%p3), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %ag-start = (f32[1024]{0}, f32[8192]{0}) all-gather-start(%p0), replica_groups={}, dimensions={0}
  %ag-done = f32[8192]{0} all-gather-done(%ag-start)
  ROOT %out = f32[64,128]{1,0} add(%fusion.2, %p1)
}
"""

TRACED = """HloModule traced

ENTRY %main (a: f32[1024], b: f32[524288]) -> (f32[8192], f32[65536]) {
  %a = f32[1024]{0} parameter(0)
  %b = f32[524288]{0} parameter(1)
  %all-gather.10 = f32[8192]{0} all-gather(%a), replica_groups={}, dimensions={0}
  %reduce-scatter.77 = f32[65536]{0} reduce-scatter(%b), replica_groups={}, dimensions={0}, to_apply=%sum
  ROOT %t = (f32[8192]{0}, f32[65536]{0}) tuple(%all-gather.10, %reduce-scatter.77)
}
"""


def _by_name():
    return {c.name: c for c in collectives(OPTIMIZED, 8, traced_collectives(TRACED))}


def test_an_async_collective_split_into_fusions_is_one_overlapped_collective():
    gather = _by_name()["all-gather.10"]
    assert gather.kind == "all-gather" and gather.asynchronous and gather.overlapped
    assert gather.compute_between == 1           # fusion.2 runs between start and done
    assert gather.bytes_per_chip == pytest.approx(7 / 8 * 8192 * 4)


def test_a_reduce_scatter_lowered_to_an_all_reduce_keeps_its_name_and_kind():
    reduce = _by_name()["reduce-scatter.77"]
    assert (reduce.kind, reduce.compiled_as) == ("reduce-scatter", "all-reduce")
    assert not reduce.asynchronous and not reduce.overlapped
    assert reduce.bytes_per_chip == pytest.approx(2 * 7 / 8 * 65536 * 4)   # what moves


def test_a_collective_in_a_loop_body_counts_once_per_trip_over_its_replica_groups():
    looped = _by_name()["all-gather.99"]
    assert looped.count == 4
    assert looped.bytes_per_chip == pytest.approx(4 * 1 / 2 * 2048 * 4)   # groups of 2


def test_start_and_done_with_nothing_between_are_asynchronous_but_not_overlapped():
    plain = _by_name()["ag-start"]
    assert plain.asynchronous and not plain.overlapped and plain.compute_between == 0


def test_the_module_parses_into_scheduled_computations():
    computations, entry = parse_module(OPTIMIZED)
    assert entry == "main"
    assert [i.opcode for i in computations["main"]][:5] == ["parameter"] * 4 + ["fusion"]
    assert computations["main"][4].callees == ["fused_start"]


@pytest.mark.parametrize("kind, result, size, sent", [
    ("all-gather", 800, 8, 700), ("reduce-scatter", 100, 8, 700),
    ("all-reduce", 800, 8, 1400), ("all-to-all", 800, 8, 700),
    ("collective-permute", 800, 8, 800), ("all-reduce", 800, 1, 0)])
def test_ring_bytes(kind, result, size, sent):
    assert bytes_sent_per_chip(kind, result, size) == pytest.approx(sent)


def test_array_bytes_and_spans():
    assert array_bytes("bf16[4,8]{1,0:T(8,128)(2,1)}") == 64
    assert array_bytes("(f32[2]{0}, s8[3]{0}, /*index=2*/pred[])") == 12
    computations, _ = parse_module(OPTIMIZED)
    ag = next(i for i in computations["body"] if i.opcode == "all-gather")
    assert span(ag, 8) == 2
    assert span(computations["main"][-2], 8) == 8
