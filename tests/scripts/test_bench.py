"""The benchmark's HLO reading and analytic bounds (no XLA needed)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import bench  # noqa: E402

HLO = """
  %all-gather.21 = f32[4096]{0} all-gather(%add.20), replica_groups={}, dimensions={0}
  %all-gather.30 = (f32[8]{0}, bf16[4,2]{1,0}) all-gather(%a, %b), replica_groups={}
  %reduce-scatter.9 = f32[256]{0} reduce-scatter(%add.8), replica_groups={}, dimensions={0}
  %all-reduce.3 = f32[] all-reduce(%x), replica_groups={}, to_apply=%sum
  %add.2 = f32[4096]{0} add(%all-gather.21, %c)
"""


def test_collectives_in_hlo_counts_bytes_each_rank_sends():
    out = bench.collectives_in_hlo(HLO, world=4)
    assert out["all-gather"] == {"count": 2, "bytes": 0.75 * (4096 * 4 + 8 * 4 + 8 * 2)}
    assert out["reduce-scatter"] == {"count": 1, "bytes": 0.75 * 256 * 4 * 4}
    assert out["all-reduce"] == {"count": 1, "bytes": 2 * 0.75 * 4}
    assert set(out) == {"all-gather", "reduce-scatter", "all-reduce"}


def test_analytic_bounds():
    cfg = bench.Config(layers=2, dim=16, heads=2, vocab=32, seq=8)
    sizes = bench.unit_sizes(cfg)
    model = bench.build_model(cfg)
    assert sum(sizes) == sum(p.numel() for p in model.parameters())
    bound = bench.analytic(cfg, devices=4)
    *blocks, root = sizes
    assert bound["min_collective_bytes"] == 4 * 0.75 * (3 * sum(blocks) + 2 * root)
    assert bound["min_peak_bytes"] == 16 * sum(sizes) / 4 + 8 * max(sizes)
