"""Checkpoints of a model whose optimizer lives on the host (``offload_optimizer=True``):
every save path writes the bytes the same model writes without offload, every load path
fills the host state, an asynchronous save keeps the state of its call while the host
optimizer steps on in place, and the manager restores into it. One launch at N=2."""
from xla_fsdp import launch

from ..support.offload_workloads import checkpoints


def test_every_checkpoint_path_is_the_same_with_the_optimizer_on_the_host(tmp_path):
    results = launch(checkpoints, (str(tmp_path),), num_devices=2)
    for rank in range(2):
        problems, places = results[rank]
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
        assert places == ["cpu"], f"rank {rank}: shards and optimizer state on {places}"
