"""The depth sweep of per-step host cost: overheads and their ratios (no XLA needed)."""
import argparse

from scripts.bench import host_scale
from scripts.bench.model import Config
from scripts.bench.step_phases import PHASES, WARMUP


def _rows(host_ms):
    """Steps whose phases add up to ``host_ms`` each, after WARMUP slow ones."""
    steps = [1000.0] * WARMUP + list(host_ms)
    return [{p: ms / 1e3 / len(PHASES) for p in PHASES} for ms in steps]


def test_overhead_is_host_minus_the_unwrapped_model_from_the_same_steps():
    rows = {"unwrapped": _rows([100, 90, 95]), "xla_fsdp": _rows([130, 120, 125]),
            "xla_fsdp_scanned": _rows([70, 60, 65]), "torch_xla": _rows([150, 140, 145])}
    s = host_scale.summarize(8, rows)
    assert s["layers"] == 8
    assert round(s["min"]["overhead_ms"]["xla_fsdp"], 6) == 30.0       # warm-up left out
    assert round(s["median"]["overhead_ms"]["torch_xla"], 6) == 50.0
    assert round(s["min"]["overhead_ms"]["xla_fsdp_scanned"], 6) == -30.0  # cheaper than unwrapped
    text = host_scale.markdown([s], Config(), argparse.Namespace(depths=[8], devices=2,
                                                                  steps=6))
    row = [line for line in text.splitlines() if line.startswith("| 8 |")][0]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[-2] == "0.60 (0.60)" and cells[-1] == "-0.60 (-0.60)"
