"""The TPU-plan benchmark's own logic, without compiling: the depth search and the table."""
from scripts.bench import tpu_plan


def test_the_deepest_model_is_found_one_layer_exactly(monkeypatch):
    probed = []

    def fake_plan(setting, topology):
        probed.append(setting.layers)
        assert (setting.impl, setting.shape, topology) == ("fsdpv2", "llama-3.1-8b", "v5e-8")
        return {"fits": setting.layers <= 11}
    monkeypatch.setattr(tpu_plan, "plan", fake_plan)
    found = tpu_plan.deepest("fsdpv2", "v5e-8", 2048, 64)
    assert found["deepest"] == 11 and found["probed"][11] and not found["probed"][12]
    assert len(probed) == len(set(probed)) <= 8       # 1, 2, 4, 8, 16, then bisection
    monkeypatch.setattr(tpu_plan, "plan", lambda s, t: {"fits": False})
    assert tpu_plan.deepest("xla_fsdp", "v5e-8", 2048, 64)["deepest"] == 0


def test_the_table_shows_what_does_not_fit_by_the_memory_it_needs():
    row = dict(impl="xla_fsdp", shape="llama-3.1-8b", layers=32, seq=2048, topology="v5e-8",
               fits=False, peak_gib=0.0, required_gib=43.42, tflops_per_chip=0.0,
               hbm_accessed_gib=0.0, collective_gib=0.0, overlapped=0, collectives=0,
               estimate_ms=None, mfu=None)
    text = tpu_plan._markdown([row], [{"impl": "xla_fsdp", "topology": "v5e-8", "seq": 2048,
                                       "deepest": 11, "probed": {11: True, 12: False}}],
                              "python -m scripts.bench.tpu_plan")
    assert "| v5e-8 | xla_fsdp | no | needs 43.42 |" in text
    assert "| xla_fsdp | v5e-8 | 2048 | 11 |" in text
