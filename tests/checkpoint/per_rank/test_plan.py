"""How the per-rank files' tensors become the unwrapped model's (``per_rank.plan``). No XLA."""
import pytest
import torch

from xla_fsdp._sharding.layout import FlatLayout
from xla_fsdp.checkpoint.consolidate.library import consolidate_state_dicts
from xla_fsdp.checkpoint.files import CheckpointError

from ...support.synthetic_checkpoints import SHAPES, flat_metadata, full_model, shard_key


def test_a_buffer_placed_in_another_dtype_is_consolidated_in_its_own():
    """``buffer_dtype=torch.bfloat16`` places a float32 buffer in bf16; the shard metadata
    records its dtype under the unwrapped model's name, while the rank files keep it under the
    wrapper's key. The consolidated state dict has it in float32, as the live model's
    consolidated save does."""
    world, full = 2, full_model()
    layout = FlatLayout((torch.Size(full["lin.bias"].shape),), world)
    wrapped = {"_orig_size": full["lin.bias"].shape, "_orig_name": "_fsdp_wrapped_module.lin.bias"}
    metadata = {
        "shard_info": {"": {shard_key("lin.bias"): wrapped}},
        "flatten_info": {}, "shared_info": {},
        "buffer_info": {"lin.seen": {"_orig_dtype": torch.float32}},
        "layout_info": {"": {shard_key("lin.bias"): {"kind": "flat", "multiple": 1}}},
        "param_order": ["lin.bias"], "update_count": 0, "world_size": world, "rank": 0}
    seen = torch.tensor([0.5, 1.25, 3.0])
    state_dicts = [{shard_key("lin.bias"): layout.shard([full["lin.bias"]], rank),
                    "_fsdp_wrapped_module.lin.seen": seen.to(torch.bfloat16)}
                   for rank in range(world)]
    out = consolidate_state_dicts(state_dicts, metadata)
    assert list(out) == ["lin.bias", "lin.seen"]
    assert torch.equal(out["lin.bias"], full["lin.bias"])
    assert out["lin.seen"].dtype == torch.float32 and torch.equal(out["lin.seen"], seen)


def _state_dicts_and_metadata(world):
    full = full_model()
    state_dicts = [{shard_key(n): FlatLayout((torch.Size(s),), world).shard([full[n]], rank)
                    for n, s in SHAPES.items()} for rank in range(world)]
    return full, state_dicts, flat_metadata(world)


def test_a_shard_left_out_of_every_rank_file_is_left_out_and_named():
    """Lightning Fabric's ``save(..., filter=)`` keeps only the keys its filter accepts, on
    every rank, under shard metadata that lists them all: the others are consolidated, and
    the ones left out are named in a warning (see [Note: shards left out of every rank
    file])."""
    world = 2
    full, state_dicts, metadata = _state_dicts_and_metadata(world)
    for sd in state_dicts:
        del sd[shard_key("lin.bias")]
    with pytest.warns(UserWarning, match=r"hold no shard of 1 parameters \(lin\.bias\)"):
        out = consolidate_state_dicts(state_dicts, metadata)
    assert list(out) == ["lin.weight"] and torch.equal(out["lin.weight"], full["lin.weight"])


def test_a_shard_some_rank_files_hold_and_others_do_not_is_refused_naming_one():
    world = 2
    _, state_dicts, metadata = _state_dicts_and_metadata(world)
    del state_dicts[1][shard_key("lin.bias")]
    with pytest.raises(CheckpointError, match=r"<state dict of rank 1> holds no shard "
                                              r".*lin_FSDP_SHARD_SEPARATOR_bias, which "
                                              r"<state dict of rank 0> holds"):
        consolidate_state_dicts(state_dicts, metadata)


def test_state_dicts_holding_no_shard_of_the_metadata_are_refused():
    # every key renamed (a torch.compile'd model's state dict adds '_orig_mod.'): not a
    # filter, which leaves some in
    _, state_dicts, metadata = _state_dicts_and_metadata(2)
    renamed = [{f"_orig_mod.{k}": v for k, v in sd.items()} for sd in state_dicts]
    with pytest.raises(CheckpointError, match=r"no shard in the shard metadata is in the model "
                                              r"state dict .*'_orig_mod\.'"):
        consolidate_state_dicts(renamed, metadata)
