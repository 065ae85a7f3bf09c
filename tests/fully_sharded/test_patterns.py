"""Forward/backward patterns of real training code train as they do unsharded (scenarios in
``tests/support/pattern_scenarios.py``): a parent's parameter passed into a child unit, backward that does
not pass through the root's output, ``retain_graph``, nested units used before the root,
dataclass outputs, freezing after wrapping, non-persistent buffers, grouped units whose
members are skipped or called twice, no-grad evaluation, ``load_state_dict(assign=True)``,
an abandoned ``no_sync`` micro-batch, one module registered under several names, a unit
registered in two places (shared layers), a forward that lists its own parameters.

One launch at N = 2 runs them all (the suite's time budget allows no more); each rank trains
the unsharded reference too. Bounds (fp32): losses within 1e-5 relative, parameters and
outputs within 1e-5.
"""
import time

import pytest
import torch

from xla_fsdp import launch
from xla_fsdp.checkpoint.consolidate.library import (consolidate_checkpoint_files,
                                                     consolidate_state_dicts)

from ..support.pattern_models import SharedEmbeddingLM, SharedLayerNet
from ..support.pattern_scenarios import SCENARIOS, run
from ..support.patterns import WORLD


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    start = time.monotonic()
    out = launch(run, (list(SCENARIOS), str(tmp_path_factory.mktemp("patterns"))),
                 num_devices=WORLD)
    print(f"\npatterns launch: {time.monotonic() - start:.1f} s; per scenario (rank 0): "
          f"{out[0]['seconds']}")
    return out


def _problems(results, name):
    """Rank 0's problems, then any other rank's that rank 0 does not share."""
    found = list(results[0]["problems"][name])
    for rank in range(1, WORLD):
        found += [f"rank {rank}: {p}" for p in results[rank]["problems"][name]
                  if p not in results[0]["problems"][name]]
    return found


def _consolidation_problems(results, name, build):
    """The ranks' torch_xla-format state dicts consolidate into one that loads strict into
    the unwrapped model (``build()``) and holds the values ``full_state_dict`` gave."""
    saved = [results[r]["extra"].get(name) for r in range(WORLD)]
    if any(s is None for s in saved):
        return ["consolidation: the scenario ended before the state dicts were taken"]
    try:
        merged = consolidate_state_dicts([s["model"] for s in saved], saved[0]["shard_metadata"])
    except Exception as exc:
        return [f"consolidation raised {type(exc).__name__}: {exc}"]
    problems = []
    try:
        build().load_state_dict(merged, strict=True)
    except Exception as exc:
        problems.append(f"the consolidated state dict does not load strict into the unwrapped "
                        f"model: {type(exc).__name__}: {' '.join(str(exc).split())}")
    full = saved[0]["full"]
    for key in sorted(set(merged) & set(full)):
        if not torch.equal(merged[key], full[key]):
            problems.append(f"consolidated {key} differs from full_state_dict's")
    return problems


def _group_problems(results):
    """Each group's gradient norm is the whole model's, and each group's files consolidate
    into its own model."""
    saved = results[0]["extra"].get("independent_groups", {})
    saved.update(results[1]["extra"].get("independent_groups", {}))
    if len(saved) != WORLD:
        return ["independent_groups: the scenario ended before saving"]
    problems = []
    for step, ((t0, n0), (t1, n1)) in enumerate(zip(saved[0]["norms"], saved[1]["norms"],
                                                     strict=True)):
        whole = (n0 ** 2 + n1 ** 2) ** 0.5
        if not abs(t0 - whole) <= 1e-5 * whole or not abs(t1 - whole) <= 1e-5 * whole:
            problems.append(f"step {step}: clip_grad_norm_ gave {t0:.7g} / {t1:.7g}, the two "
                            f"groups' models together have norm {whole:.7g}")
    for rank in range(WORLD):
        path = saved[rank]["path"]
        suffix = f"groups_group-{rank:03d}_rank-00000000-of-00000001.pth"
        if path is None or not path.endswith(suffix):
            problems.append(f"rank {rank} wrote {path}, expected a file named *{suffix}")
            continue
        merged, _ = consolidate_checkpoint_files(
            path[:-len("_rank-00000000-of-00000001.pth")], "_rank-*-of-*.pth",
            save_model=False, wait_seconds=0)
        for key, value in saved[rank]["full"].items():
            if not torch.equal(merged[key], value):
                problems.append(f"group {rank}'s consolidated {key} differs from its model")
    return problems


# scenarios whose ranks' state dicts are consolidated here, with the unwrapped model
CONSOLIDATED = {"shared_module_names": SharedEmbeddingLM, "shared_layer_unit": SharedLayerNet}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_pattern(results, name):
    problems = _problems(results, name)
    if name in CONSOLIDATED:
        problems += _consolidation_problems(results, name, CONSOLIDATED[name])
    if name == "independent_groups":
        problems += _group_problems(results)
    assert not problems, "\n".join(problems)
