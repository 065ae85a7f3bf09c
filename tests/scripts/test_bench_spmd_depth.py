"""The benchmark's phase summaries, FSDPv2 column and depth-sweep report (no XLA needed)."""
import argparse

from scripts.bench import depth, hlo, measure, model, report

DEBUG = """Post Compilation Analysis: ====
Post Compilation Analysis: Graph input size: 0.010339 GB
Post Compilation Analysis: Graph output size: 0.016973 GB
Post Compilation Analysis: Aliased Input size: 0.010338 GB
Post Compilation Analysis: Intermediate tensor size: 0.006567 GB
Post Compilation Analysis: Compiled program size: 0.000000 GB
"""


def test_memory_stats_and_peak():
    stats = hlo.memory_stats(DEBUG + DEBUG.replace("0.006567", "0.5"))
    assert stats[0] == {"input": 0.010339, "output": 0.016973, "aliased": 0.010338,
                        "temp": 0.006567}
    assert stats[1]["temp"] == 0.5
    assert hlo.peak_of(stats[0]) == (0.010339 + 0.016973 - 0.010338 + 0.006567) * 2**30


def _run(times, host_per_rank, wait, startup=10.0, compile_s=5.0):
    # a rank's host time is its thread's plus its backward thread's: here 3/4 and 1/4
    per_rank = [{"host": h, "host_thread": [x * 0.75 for x in h],
                 "host_backward": [x * 0.25 for x in h]} for h in host_per_rank]
    return {"times": times, "dispatch": times, "wait": wait, "execute": wait,
            "per_rank": per_rank, "startup_seconds": startup,
            "compile_seconds": compile_s, "compile_seconds_step_1": compile_s / 2}


def test_phases_take_medians_after_warmup_and_a_rank_s_own_host_time():
    runs = [_run([9, 1.0, 1.0], [[9, 0.1, 0.1], [9, 0.3, 0.3], [9, 0.2, 0.2]], [9, 0.5, 0.5]),
            _run([9, 3.0, 3.0], [[9, 0.4, 0.4]], [9, 0.7, 0.7], startup=20.0),
            _run([9, 2.0, 2.0], [[9, 0.6, 0.6]], [9, 0.9, 0.9], startup=30.0)]
    out = measure.phases(runs, warmup=1)
    assert out["step_seconds"] == 2.0
    assert out["host_seconds"] == 0.4        # medians over ranks: 0.2, 0.4, 0.6
    assert abs(out["host_thread_seconds"] - 0.3) < 1e-12
    assert abs(out["host_backward_seconds"] - 0.1) < 1e-12
    assert out["wait_seconds"] == 0.7
    assert out["startup_seconds"] == 20.0
    assert out["execute_seconds"] == 0.7


def test_pod_estimate_is_host_plus_execute():
    out = report.with_estimates([{"host_seconds": 0.25, "execute_seconds": 0.5},
                                 {"crashed": "x"}])
    assert out == [{"host_seconds": 0.25, "execute_seconds": 0.5,
                    "pod_estimate_seconds": 0.75}, {"crashed": "x"}]


def test_crash_reason_tells_an_unavailable_variant_from_a_crash():
    missing = RuntimeError("rank 0 raised ImportError\nTraceback ...\nImportError: cannot "
                           "import name 'ScannedLayers' from 'xla_fsdp'")
    assert measure.crash_reason(missing) == ("unavailable: cannot import name "
                                             "'ScannedLayers' from 'xla_fsdp'")
    assert measure.crash_reason(RuntimeError("killed by SIGSEGV\nmore")) == "killed by SIGSEGV"


def test_fsdpv2_runs_only_where_its_options_are_the_same():
    wanted = ["xla_fsdp", "torch_xla", "fsdpv2", "unwrapped", "spmd_unwrapped"]
    assert measure.impls_for("defaults", wanted) == wanted
    assert measure.impls_for("flattened", wanted) == ["xla_fsdp", "torch_xla", "unwrapped"]


def test_host_split_subtracts_each_competitor_s_own_baseline():
    def result(impl, host, execute=0.5):
        return {"impl": impl, "setting": "defaults", "devices": 4, "host_seconds": host,
                "host_thread_seconds": host * 0.75, "host_backward_seconds": host * 0.25,
                "execute_seconds": execute, "pod_estimate_seconds": host + execute}
    results = [result("xla_fsdp", 0.110), result("torch_xla", 0.140),
               result("fsdpv2", 0.090, 0.6), result("unwrapped", 0.100),
               result("spmd_unwrapped", 0.080)]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in report.host_split(results) if line.startswith("| ")}
    # ours: 10 ms over the per-rank baseline, torch_xla's 40: 0.25x; host + execute
    # 610 ms against FSDPv2's 690
    assert rows["xla_fsdp"][2] == "10.0" and rows["xla_fsdp"][3] == "0.25"
    assert rows["xla_fsdp"][6] == f"{0.610 / 0.690:.3f}"
    assert rows["torch_xla"][2] == "40.0"
    assert rows["fsdpv2"][1] == "80.0" and rows["fsdpv2"][2] == "10.0"  # its SPMD baseline
    assert "unwrapped" not in rows and "spmd_unwrapped" not in rows
    assert report.host_split([r for r in results if "unwrapped" not in r["impl"]]) == []


def _result(impl, setting="defaults", **extra):
    cfg = model.Config(layers=2, dim=16, heads=2, vocab=32, seq=8)
    base = {"impl": impl, "setting": setting, "devices": 4,
            "analytic": dict(measure.analytic(cfg, 4), min_peak_bytes=100.0,
                             min_collective_bytes=1000.0),
            "step_seconds": 1.0, "first_step_seconds": 5.0, "second_step_seconds": 4.0,
            "ready_seconds": 6.0, "wrap_seconds": 1.0, "graphs_compiled": 4,
            "recompiles_after_step_2": 0, "collectives": {"all-gather": {"count": 9}},
            "collective_bytes": 1000.0, "peak_bytes": 130.0, "losses": [1.0],
            "global_losses": [1.0], "step_seconds_runs": [1.0], "startup_seconds": 10.0,
            "compile_seconds": 3.0, "host_seconds": 0.2, "dispatch_seconds": 0.8,
            "wait_seconds": 0.2, "execute_seconds": 0.2}
    base.update(extra)
    return base


def test_report_adds_the_fsdpv2_column_and_its_summary():
    cfg = model.Config(layers=2, dim=16, heads=2, vocab=32, seq=8)
    results = [_result("xla_fsdp"), _result("torch_xla", step_seconds=2.0),
               _result("fsdpv2", step_seconds=0.5, peak_bytes=260.0, graphs_compiled=2,
                       collectives={"all-reduce": {"count": 3}}, global_losses=[1.5]),
               _result("xla_fsdp", "flattened"), _result("torch_xla", "flattened")]
    args = argparse.Namespace(devices=[4], settings=["defaults", "flattened"], repeats=1,
                              warmup=1, impls=["xla_fsdp", "torch_xla", "fsdpv2"])
    text = report.markdown_report(args, cfg, results, "test machine")
    assert text.startswith("# Training step: xla_fsdp vs torch_xla's FSDP and SPMD FSDPv2")
    assert "| defaults | 4 | 2.000 | 1.000 | 1.000 | 1.000 | 1.000 | 1.000 | 0.500 |" in text
    assert "| host + execute: a step without serialized tracing (s) | 0.400 |" in text
    assert ("| median step time (s) | 1.000 | 2.000 | 0.500 | 0.500 | 2.000 | "
            "<= 0.85 (met) |") in text
    assert "| graphs compiled | 4 | 4 | 1.000 | 2 | 2.000 | <= theirs (met) |" in text
    assert "| all-reduce per step | 0 | 0 | nan | 3 | 0.000 |  |" in text
    assert "| host time per rank per step (s, CPU) | 0.200 | 0.200 | 1.000 | 0.200 |" in text
    assert "FSDPv2's: 5.00e-01" in text
    # the flattened setting has no FSDPv2: its table keeps the two-wrapper layout
    flattened = text[text.index("## flattened, N = 4"):]
    assert "| median step time (s) | 1.000 | 1.000 | 1.000 | <= 0.85 (**missed**) |" in flattened


def test_report_names_a_crashed_fsdpv2():
    cfg = model.Config(layers=2, dim=16, heads=2, vocab=32, seq=8)
    results = [_result("xla_fsdp"), _result("torch_xla"),
               {"impl": "fsdpv2", "setting": "defaults", "devices": 4,
                "crashed": "the SPMD process died (exit code -11)"}]
    args = argparse.Namespace(devices=[4], settings=["defaults"], repeats=1, warmup=1)
    text = report.markdown_report(args, cfg, results, "test machine")
    assert "| defaults | 4 | FSDPv2: the SPMD process died (exit code -11) |" in text
    assert ("| median step time (s) | 1.000 | 1.000 | 1.000 | the SPMD process died (exit "
            "code -11) |  | <= 0.85 (**missed**) |") in text


def _depth_results():
    out = []
    for depth, unscanned_startup in ((4, 20.0), (64, 200.0)):
        out += [dict(_result("xla_fsdp", startup_seconds=unscanned_startup), layers=depth),
                dict(_result("xla_fsdp_scanned", startup_seconds=40.0,
                             peak_bytes=float("nan")), layers=depth),
                dict(_result("fsdpv2", step_seconds=0.5, global_losses=[1.25]), layers=depth),
                {"impl": "fsdpv2_scan", "setting": "defaults", "devices": 4, "layers": depth,
                 "crashed": "unavailable: No module named 'jax'"}]
    return out


def test_depth_sweep_tables_and_ratios():
    args = argparse.Namespace(devices=4, repeats=2, warmup=3, inspect=True,
                              variants=list(depth.VARIANTS))
    cfg = model.Config(dim=256, heads=4, vocab=2048, seq=64, steps=6)
    text = depth.markdown(args, cfg, _depth_results(), "test machine")
    assert "--depths 4 64 --devices 4 --repeats 2 --steps 6" in text
    assert ("| xla_fsdp | 20.0 | 5.00 | 3.00 | 4 | 1.000 | 0.200 | 0.800 | 0.200 | 0.200 "
            "| 0.400 | 0.0 | 0.0e+00 |") in text
    assert "| 0.0 | 2.5e-01 |" in text  # fsdpv2's global loss 1.25 against 1.0
    assert "| xla_fsdp_scanned | 40.0 |" in text and "| n/a |" in text  # NaN memory
    assert "| fsdpv2_scan | - | - |" in text
    assert "fsdpv2_scan: unavailable: No module named 'jax'" in text
    assert ("| ours scanned / ours unscanned, first step from process start | 2.000 | 0.200 "
            "| <= 0.25 |") in text
    assert "| ours / FSDPv2, median step | 2.000 | 2.000 | <= 1.0 |" in text
    # a ratio whose variants never both ran is left out
    assert "FSDPv2 scan / FSDPv2" not in text
    assert "ours scanned / FSDPv2 scan" not in text


def test_depth_ratio_skips_missing_crashed_and_nan():
    group = {"a": {"x": 2.0}, "b": {"x": 4.0}, "c": {"crashed": "no"},
             "d": {"x": float("nan")}}
    assert depth.ratio(group, "a", "b", "x") == 0.5
    assert depth.ratio(group, "a", "c", "x") is None
    assert depth.ratio(group, "a", "d", "x") is None
    assert depth.ratio(group, "a", "zzz", "x") is None
