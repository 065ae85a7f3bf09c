"""The device process's environment: what XLA:CPU must be told before it starts, and a
scanned step whose collectives stay in order on every device (see [Note: collectives in
program order on XLA:CPU])."""
import math

import pytest

from tests.support import matrix
from tests.support.checks import every, nonempty
from xla_fsdp import launch
from xla_fsdp.launch.virtual.worker import MAPS_PER_PROGRAM, environment, xla_flags


def test_the_list_scheduler_is_added_to_inherited_flags_unless_they_choose_one():
    assert xla_flags("") == "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    assert xla_flags("--xla_backend_optimization_level=0") == (
        "--xla_backend_optimization_level=0 "
        "--xla_cpu_enable_concurrency_optimized_scheduler=false")
    chosen = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    assert xla_flags(chosen) == chosen


def test_the_compiled_programs_kept_fit_in_half_the_process_memory_maps():
    # see [Note: compiled programs within the process's memory maps]
    per_program, kept, limit = launch(_maps_per_compiled_program, (24,), num_devices=1)[0]
    assert 10 < per_program <= MAPS_PER_PROGRAM, per_program
    assert kept * per_program < limit / 2, (kept, per_program, limit)


def test_a_users_compilation_cache_size_is_kept(monkeypatch):
    monkeypatch.setenv("XLA_COMPILATION_CACHE_SIZE", "100")
    assert environment(2)["XLA_COMPILATION_CACHE_SIZE"] == "100"


def _maps_per_compiled_program(rank, graphs):
    import os

    import torch
    import torch_xla

    def maps():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    torch_xla.sync()
    before = maps()
    for i in range(graphs):
        x = torch.ones(8 + i, 16, device=torch_xla.device())
        (torch.relu(x @ x.T).sum(0).softmax(0) * 3).sum().item()
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    return (maps() - before) / graphs, int(os.environ["XLA_COMPILATION_CACHE_SIZE"]), limit


@pytest.mark.slow
def test_a_scanned_step_keeps_its_collectives_in_order_with_many_xla_threads(
        monkeypatch, tmp_path):
    # With 16 XLA:CPU threads and the default scheduler, every launch of these steps
    # aborted within seconds (a rendezvous with three arrivals for two devices).
    monkeypatch.setenv("PJRT_NPROC", "16")
    cell = matrix.Cell("scanned", "default", "AdamW", False, "dcp", "same")
    out = launch(_train_repeatedly, (cell, str(tmp_path), 4), num_devices=2)
    assert out[0] == out[1]
    assert len(out[0]) == 4 and every(math.isfinite(x) for losses in out[0] for x in losses)


def _train_repeatedly(rank, cell, root, times):
    results = [matrix.run_cells(rank, [cell], root)[cell] for _ in range(times)]
    for r in nonempty(results, "runs"):
        assert "refused" not in r, r["refused"]
    return [r["losses"] for r in results]
