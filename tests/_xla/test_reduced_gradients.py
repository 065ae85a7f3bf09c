"""The audit of what happens to gradients after their reduce-scatter, on HLO text written the
way torch_xla lowers it (no XLA needed). [Note: auditing reduced gradients]"""
from xla_fsdp._xla.reduced_gradients import ALL_REDUCED, LOCAL_SCALE, audit

HEAD = """HloModule IrToHlo.1

%AddComputation.1 (x.2: f32[], y.3: f32[]) -> f32[] {
  %x.2 = f32[] parameter(0)
  %y.3 = f32[] parameter(1)
  ROOT %add.4 = f32[] add(f32[] %x.2, f32[] %y.3)
}

ENTRY %IrToHlo.5 (p0.6: f32[8], p1.7: f32[8], p2.8: f32[]) -> (f32[4], f32[4]) {
  %p0.6 = f32[8]{0} parameter(0)
  %p1.7 = f32[8]{0} parameter(1)
  %p2.8 = f32[] parameter(2)
  %rs.10 = (f32[4]{0}, f32[]) reduce-scatter(f32[8]{0} %p0.6, f32[] %p2.8), replica_groups=GROUPS, constrain_layout=true, dimensions={0}, to_apply=%AddComputation.1
  %g.11 = f32[4]{0} get-tuple-element((f32[4]{0}, f32[]) %rs.10), index=0
  %token.12 = f32[] get-tuple-element((f32[4]{0}, f32[]) %rs.10), index=1
  %rs.13 = f32[4]{0} reduce-scatter(f32[8]{0} %p1.7), replica_groups=GROUPS, dimensions={0}, to_apply=%AddComputation.1
  %c.14 = f32[] constant(0.5)
  %b.15 = f32[4]{0} broadcast(f32[] %c.14), dimensions={}
  %g.16 = f32[4]{0} multiply(f32[4]{0} %g.11, f32[4]{0} %b.15)
"""


def _module(body, root="%g.16, f32[4]{0} %rs.13", groups="{}"):
    return (HEAD.replace("GROUPS", groups) + body +
            f"  ROOT %tuple.99 = (f32[4]{{0}}, f32[4]{{0}}) tuple(f32[4]{{0}} {root})\n}}\n")


def _norm_of_both(through_all_reduce):
    """A clip coefficient from the squared norms of both reduced gradients, taken over all
    ranks or over this rank's slices alone."""
    body = """  %sq.20 = f32[4]{0} multiply(f32[4]{0} %g.16, f32[4]{0} %g.16)
  %sq.21 = f32[4]{0} multiply(f32[4]{0} %rs.13, f32[4]{0} %rs.13)
  %zero.22 = f32[] constant(0)
  %r.23 = f32[] reduce(f32[4]{0} %sq.20, f32[] %zero.22), dimensions={0}, to_apply=%AddComputation.1
  %r.24 = f32[] reduce(f32[4]{0} %sq.21, f32[] %zero.22), dimensions={0}, to_apply=%AddComputation.1
  %sum.25 = f32[] add(f32[] %r.23, f32[] %r.24)
"""
    if through_all_reduce:
        body += """  %ar.26 = (f32[], f32[]) all-reduce(f32[] %sum.25, f32[] %token.12), replica_groups={}, to_apply=%AddComputation.1
  %total.27 = f32[] get-tuple-element((f32[], f32[]) %ar.26), index=0
"""
    else:
        body += "  %total.27 = f32[] add(f32[] %sum.25, f32[] %zero.22)\n"
    body += """  %coef.28 = f32[] rsqrt(f32[] %total.27)
  %bc.29 = f32[4]{0} broadcast(f32[] %coef.28), dimensions={}
  %clipped.30 = f32[4]{0} multiply(f32[4]{0} %g.16, f32[4]{0} %bc.29)
  %clipped.31 = f32[4]{0} multiply(f32[4]{0} %rs.13, f32[4]{0} %bc.29)
"""
    return _module(body, root="%clipped.30, f32[4]{0} %clipped.31")


def test_reduced_gradients_scaled_and_stepped_pass():
    assert audit(_module("")) == []


def test_a_norm_over_all_ranks_passes_and_one_rank_alone_is_found():
    assert audit(_norm_of_both(through_all_reduce=True)) == []
    found = audit(_norm_of_both(through_all_reduce=False))
    assert [(f.output, f.what) for f in found] == [(0, LOCAL_SCALE), (1, LOCAL_SCALE)]
    assert {f.instruction for f in found} <= {"r.23", "r.24"}   # a local norm's reduce


def test_an_all_reduce_of_the_gradient_is_found_unless_it_keeps_slices_apart():
    body = """  %ar.20 = (f32[4]{0}, f32[]) all-reduce(f32[4]{0} %g.16, f32[] %token.12), replica_groups=ARG, to_apply=%AddComputation.1
  %avg.21 = f32[4]{0} get-tuple-element((f32[4]{0}, f32[]) %ar.20), index=0
"""
    def found(rs_groups, ar_groups):
        return [(f.output, f.what) for f in audit(
            _module(body.replace("ARG", ar_groups), root="%avg.21, f32[4]{0} %rs.13",
                    groups=rs_groups))]
    assert found("{}", "{}") == [(0, ALL_REDUCED)]
    assert found("{{0,1},{2,3}}", "{}") == [(0, ALL_REDUCED)]
    assert found("{{0,1},{2,3}}", "[2,2]<=[4]") == [(0, ALL_REDUCED)]   # iota: the same groups
    # hybrid sharding: replicas of one slice are averaged across sharding groups
    assert found("{{0,1},{2,3}}", "{{0,2},{1,3}}") == []
    assert found("{{0,1},{2,3}}", "[2,2]<=[2,2]T(1,0)") == []           # the same, as iota


def test_a_barrier_tuple_leads_only_to_its_own_element():
    """Optimization barriers tie a gradient to the backward's other values; a reduction
    among those others is not applied to the gradient."""
    body = """  %zero.20 = f32[] constant(0)
  %act.21 = f32[4]{0} multiply(f32[4]{0} %rs.13, f32[4]{0} %rs.13)
  %r.22 = f32[] reduce(f32[4]{0} %act.21, f32[] %zero.20), dimensions={0}, to_apply=%AddComputation.1
  %t.23 = (f32[4]{0}, f32[]) tuple(f32[4]{0} %g.16, f32[] %r.22)
  %ob.24 = (f32[4]{0}, f32[]) opt-barrier((f32[4]{0}, f32[]) %t.23)
  %out.25 = f32[4]{0} get-tuple-element((f32[4]{0}, f32[]) %ob.24), index=0
"""
    assert audit(_module(body, root="%out.25, f32[4]{0} %rs.13")) == []


def test_an_element_past_index_5_is_read_by_its_index_not_the_shape_comment():
    """XLA prints ``/*index=5*/`` inside long tuple shapes; the element read is the one
    named by the instruction's own ``index=``."""
    shape = "(f32[], f32[], f32[], f32[], f32[], /*index=5*/f32[], f32[4]{0})"
    body = f"""  %zero.20 = f32[] constant(0)
  %act.21 = f32[4]{{0}} multiply(f32[4]{{0}} %rs.13, f32[4]{{0}} %rs.13)
  %r.22 = f32[] reduce(f32[4]{{0}} %act.21, f32[] %zero.20), dimensions={{0}}, to_apply=%AddComputation.1
  %t.23 = {shape} tuple(f32[] %r.22, f32[] %r.22, f32[] %r.22, f32[] %r.22, f32[] %r.22, f32[] %r.22, f32[4]{{0}} %g.16)
  %ob.24 = {shape} opt-barrier({shape} %t.23)
  %out.25 = f32[4]{{0}} get-tuple-element({shape} %ob.24), index=6
"""
    assert audit(_module(body, root="%out.25, f32[4]{0} %rs.13")) == []
