"""What the traced process writes into a captured graph's HLO: donations in the header,
shardings on parameters."""
from xla_fsdp.aot.libtpu_worker import donors_in_header
from xla_fsdp.aot.traced.step_graphs import with_donors, with_parameter_shardings

HLO = """HloModule IrToHlo.7, entry_computation_layout={(f32[8]{0}, f32[8]{0})->(f32[8]{0})}

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %IrToHlo.7 (p0.1: f32[8], p1.2: f32[8]) -> (f32[8]) {
  %p1.2 = f32[8]{0} parameter(1)
  %p0.1 = f32[8]{0} parameter(0), sharding={replicated}
  %add.3 = f32[8]{0} add(f32[8]{0} %p0.1, f32[8]{0} %p1.2)
  ROOT %tuple.4 = (f32[8]{0}) tuple(f32[8]{0} %add.3)
}
"""


def test_donations_go_into_the_header_where_the_compiler_reads_them():
    out = with_donors(HLO, [1])
    assert out.startswith("HloModule IrToHlo.7, buffer_donor={ (1, {}) }, entry_computation")
    assert donors_in_header(out) == [1]
    assert with_donors(HLO, []) == HLO


def test_shardings_go_on_entry_parameters_that_have_none():
    spec = "{devices=[4]0,1,2,3}"
    out = with_parameter_shardings(HLO, {0: spec, 1: spec})
    assert f"%p1.2 = f32[8]{{0}} parameter(1), sharding={spec}" in out
    assert "%p0.1 = f32[8]{0} parameter(0), sharding={replicated}\n" in out  # kept as named
    assert "%x = f32[] parameter(0)\n" in out                                 # not the entry's
    assert with_parameter_shardings(HLO, {}) == HLO
