"""PEFT (LoRA) adapters trained on our FSDP save what they save unsharded.

peft picks an adapter's entries out of the full state dict by names it reads off the model's
modules, which nested units change (see [Note: peft's names under nested units] in
``xla_fsdp/_unit/peft_names.py``); without the fix the adapter is saved empty or partial.

* Trainer, unchanged, with ``fsdp="full_shard"`` after ``patch_torch_xla()`` at N = 4
  against plain data-parallel Trainer: the same adapter file, the same outputs once loaded
  with ``PeftModel.from_pretrained``, a merged model ``from_pretrained`` loads with no key
  missing or unexpected; the frozen base is never reduced and has no optimizer state.
* A loop wrapped by xla_fsdp directly (a unit per decoder layer), the adapter saved from
  ``full_state_dict`` with ``save_pretrained(state_dict=...)``, against the same steps
  unsharded, for LoRA alone, ``modules_to_save``, ``bias="lora_only"`` and a LoRA embedding;
  and ``get_peft_model`` on an already wrapped model refused by name.
* What is installed, and when: nothing until peft is imported.
"""
import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from xla_fsdp import launch

pytest.importorskip("peft")
from ..support import peft_workloads as work  # noqa: E402 (imports peft)
from ..support.checks import every, nonempty  # noqa: E402
from ..support.parity import paired  # noqa: E402

BOUND = 1e-5
ADAPTER = "adapter_model.safetensors"


def _adapter(directory):
    return safetensors.torch.load_file(os.path.join(directory, ADAPTER))


def _same_adapter(ours_dir, theirs_dir):
    ours, theirs = _adapter(ours_dir), _adapter(theirs_dir)
    assert sorted(ours) == sorted(theirs), (sorted(ours), sorted(theirs))
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    assert worst <= BOUND, worst
    return len(theirs), worst


def _logits(model):
    with torch.no_grad():
        return model(input_ids=work.probe_ids()).logits


# -- Trainer --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("peft_trainer")
    plain_dir, fsdp_dir = str(base / "plain"), str(base / "fsdp")
    plain = launch(work.run_trainer, (plain_dir, False), num_devices=work.WORLD)[0]
    sharded = launch(work.run_trainer, (fsdp_dir, True), num_devices=work.WORLD)[0]
    return {"plain": plain, "fsdp": sharded, "plain_dir": plain_dir, "fsdp_dir": fsdp_dir,
            "base": base}


@pytest.mark.slow
def test_trainer_adapter_matches_plain_trainer(trainer_runs):
    from peft import PeftModel
    run = trainer_runs
    assert run["fsdp"]["wrapped_by"] == "xla_fsdp.fully_sharded"
    for step, (a, b) in paired(run["fsdp"]["losses"], run["plain"]["losses"]):
        assert abs(a - b) <= BOUND * abs(b), (step, a, b)
    count, _ = _same_adapter(run["fsdp_dir"], run["plain_dir"])
    assert count == 8  # lora_A and lora_B of q_proj and v_proj in two layers
    loaded = {name: PeftModel.from_pretrained(work.base_model(), run[f"{name}_dir"])
              for name in ("fsdp", "plain")}
    ours, theirs = _logits(loaded["fsdp"]), _logits(loaded["plain"])
    assert (ours - theirs).abs().max().item() <= BOUND
    # training moved the adapter, so the comparison means something
    assert (theirs - _logits(work.base_model())).abs().max().item() > 1e-3
    # installed in the launched process by the units Trainer built
    assert sorted(run["fsdp"]["installed"]) == [
        "peft.utils.other.ModulesToSaveWrapper.adapter_state_dict",
        "peft.utils.save_and_load.get_peft_model_state_dict"]


@pytest.mark.slow
def test_trainer_adapter_merges_into_a_plain_model(trainer_runs):
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    run = trainer_runs
    merged = {}
    for name in ("fsdp", "plain"):
        target = str(run["base"] / f"merged_{name}")
        PeftModel.from_pretrained(work.base_model(), run[f"{name}_dir"]) \
            .merge_and_unload().save_pretrained(target)
        model, info = LlamaForCausalLM.from_pretrained(target, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info   # lists or sets
        merged[name] = model
    ours, theirs = _logits(merged["fsdp"]), _logits(merged["plain"])
    assert (ours - theirs).abs().max().item() <= BOUND
    assert (theirs - _logits(work.base_model())).abs().max().item() > 1e-3


@pytest.mark.slow
def test_trainer_frozen_base_is_neither_reduced_nor_optimized(trainer_runs):
    """Independent of the names fix: shard groups keep trainable and frozen parameters
    apart, and only trainable ones are reduced and stepped."""
    run = trainer_runs["fsdp"]
    assert len(run["at_steps"]) == work.TRAINER_STEPS
    for step, groups in enumerate(nonempty(run["at_steps"], "steps")):
        for g in nonempty(groups, f"step {step}'s shard groups"):
            lora = every((".lora_" in n for n in g["names"]), "names")
            # a shard group holds LoRA parameters only or base parameters only
            assert lora or not any(".lora_" in n for n in g["names"]), g
            assert g["trains"] == lora and g["grad"] == lora, (step, g)
    trained = [g for g in run["after"] if g["trains"]]
    assert len(trained) == 8
    for g in nonempty(run["after"], "shard groups"):
        assert g["in_optimizer"] == g["state"] == g["trains"], g


# -- a loop wrapped by xla_fsdp directly ---------------------------------------------------
@pytest.mark.slow
def test_wrapped_lora_saves_the_unsharded_adapter(tmp_path):
    results = launch(work.train_variants, (str(tmp_path), list(work.VARIANTS)),
                     num_devices=work.WORLD)[0]
    counts = {}
    for name in nonempty(work.VARIANTS, "variants"):
        result = results[name]
        assert "error" not in result, result.get("error")
        for step, (a, b) in paired(result["losses"], result["plain_losses"]):
            assert abs(a - b) <= BOUND * abs(b), (name, step, a, b)
        counts[name], _ = _same_adapter(str(tmp_path / name / "fsdp"),
                                        str(tmp_path / name / "plain"))
        for g in nonempty(result["shards"], f"{name}'s shard groups"):
            assert g["state"] == g["trains"], (name, g)
        assert "pass state_dict=full_state_dict(model)" in result["no_state_dict"], result
        assert "save_pretrained() was given no state_dict, and FSDP units stand in" in \
            result["no_state_dict_base"], result["no_state_dict_base"]
        assert "resize_token_embeddings() on a model inside FSDP units" in result["resized"], \
            result["resized"]
    # what each variant adds to the 8 LoRA tensors
    assert counts == {"lora": 8, "modules_to_save": 8 + 3, "bias_lora_only": 8 + 4,
                      "embedding": 8 + 3}, counts
    refused = results["wrapped_first"]
    assert "added to the model after it was wrapped" in refused, refused
    assert "model.layers.0.self_attn.q_proj.lora_A.default.weight" in refused, refused


def test_a_target_that_does_not_exist_is_peft_own_error():
    """peft refuses it before any unit exists, naming the target."""
    from peft import LoraConfig, get_peft_model
    with pytest.raises(ValueError, match="nonexistent"):
        get_peft_model(work.base_model(), LoraConfig(target_modules=["nonexistent"]))


INSTALL = """
import json, sys
from xla_fsdp._unit import peft_names
peft_names.install()
before = ("peft" in sys.modules, list(peft_names._wrapped))
import peft, peft.peft_model
from peft.utils import ModulesToSaveWrapper
peft_names.install()
peft_names.install()
print(json.dumps({
    "before": before, "after": list(peft_names._wrapped),
    "rebound": [m for m in ("peft", "peft.utils", "peft.peft_model", "peft.utils.save_and_load")
                if hasattr(getattr(sys.modules[m], "get_peft_model_state_dict"), "__wrapped__")],
    "method": hasattr(ModulesToSaveWrapper.adapter_state_dict, "__wrapped__"),
}))
"""


def test_installed_once_peft_is_imported_never_importing_it():
    """Built units before peft is imported install nothing and import nothing; after, both
    wrappers are installed once, in every module of peft holding the function (a peft
    without either would leave it out here)."""
    out = subprocess.run([sys.executable, "-c", INSTALL], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert out.returncode == 0, out.stderr[-3000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["before"] == [False, []], facts
    assert facts["after"] == ["peft.utils.save_and_load.get_peft_model_state_dict",
                              "peft.utils.other.ModulesToSaveWrapper.adapter_state_dict"], facts
    assert facts["rebound"] == ["peft", "peft.utils", "peft.peft_model",
                                "peft.utils.save_and_load"], facts
    assert facts["method"], facts
