"""The benchmark's HLO reading and analytic bounds (no XLA needed)."""
import argparse

from scripts.bench import hlo, measure, model, report

HLO = """
  %all-gather.21 = f32[4096]{0} all-gather(%add.20), replica_groups={}, dimensions={0}
  %all-gather.30 = (f32[8]{0}, bf16[4,2]{1,0}) all-gather(%a, %b), replica_groups={}
  %all-gather.40 = (f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, /*index=5*/f32[6]{0}) all-gather(%a, %b, %c, %d, %e, /*index=5*/%f), replica_groups={}, dimensions={0}
  %reduce-scatter.9 = f32[256]{0} reduce-scatter(%add.8), replica_groups={}, dimensions={0}
  %all-reduce.3 = f32[] all-reduce(%x), replica_groups={}, to_apply=%sum
  %add.2 = f32[4096]{0} add(%all-gather.21, %c)
"""


def test_collectives_in_hlo_counts_bytes_each_rank_sends():
    out = hlo.collectives_in_hlo(HLO, world=4)
    assert out["all-gather"] == {"count": 3,
                                 "bytes": 0.75 * (4096 * 4 + 8 * 4 + 8 * 2 + 16 * 4)}
    assert out["reduce-scatter"] == {"count": 1, "bytes": 0.75 * 256 * 4 * 4}
    assert out["all-reduce"] == {"count": 1, "bytes": 2 * 0.75 * 4}
    assert set(out) == {"all-gather", "reduce-scatter", "all-reduce"}


def test_analytic_bounds():
    cfg = model.Config(layers=2, dim=16, heads=2, vocab=32, seq=8)
    sizes = model.unit_sizes(cfg)
    gpt = model.build_model(cfg)
    assert sum(sizes) == sum(p.numel() for p in gpt.parameters())
    bound = measure.analytic(cfg, devices=4)
    *blocks, root = sizes
    assert bound["min_collective_bytes"] == 4 * 0.75 * (3 * sum(blocks) + 2 * root)
    assert bound["min_peak_bytes"] == 16 * sum(sizes) / 4 + 8 * max(sizes)


def test_report_shows_a_crashed_competitor_and_keeps_our_own_bounds():
    cfg = model.Config(layers=2, dim=16, heads=2, vocab=32, seq=8)
    bound = dict(measure.analytic(cfg, devices=4), min_peak_bytes=100.0,
                 min_collective_bytes=1000.0)
    ours = {"impl": "xla_fsdp", "setting": "coalesced", "devices": 4, "analytic": bound,
            "step_seconds": 1.0, "first_step_seconds": 5.0, "second_step_seconds": 4.0,
            "ready_seconds": 6.0, "wrap_seconds": 1.0, "graphs_compiled": 4,
            "recompiles_after_step_2": 0, "collectives": {"all-gather": {"count": 9}},
            "collective_bytes": 1000.0, "peak_bytes": 130.0, "losses": [1.0],
            "step_seconds_runs": [1.0]}
    theirs = {"impl": "torch_xla", "setting": "coalesced", "devices": 4, "analytic": bound,
              "crashed": "the device process was killed by signal SIGSEGV"}
    args = argparse.Namespace(devices=[4], settings=["coalesced"], repeats=1, warmup=1)
    text = report.markdown_report(args, cfg, [theirs, ours], "test machine")
    assert "| coalesced | 4 | n/a | n/a | n/a | 4 vs crashed | 1.0000 | n/a | 1.300 |" in text
    assert "| median step time (s) | 1.000 | crashed |  | <= 0.85 (n/a) |" in text
    assert "| 1.300 | crashed |  | <= 1.25 (**missed**) |" in text
    assert "torch_xla: the device process was killed by signal SIGSEGV" in text
