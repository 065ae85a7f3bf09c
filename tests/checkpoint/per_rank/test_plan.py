"""How the per-rank files' tensors become the unwrapped model's (``per_rank.plan``). No XLA."""
import torch

from xla_fsdp._sharding.layout import FlatLayout
from xla_fsdp.checkpoint.consolidate.library import consolidate_state_dicts

from ...support.synthetic_checkpoints import full_model, shard_key


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
