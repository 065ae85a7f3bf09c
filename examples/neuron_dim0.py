"""The AWS Neuron setting: shard every parameter along dim 0, never flatten.

    python examples/neuron_dim0.py

Neuron's compiler mishandles flattened parameters, so ``shard_param_on_dim_0=True`` keeps
each parameter's shape and gives every rank a block of rows. When the rows do not divide by
the number of devices they are padded, and ``repr(unit)`` lists the padded parameters. On a
Trainium instance the same code runs on the NeuronCores (``launch`` defers to torch_xla).
The full example takes the same switch: ``python examples/train_lm.py --dim0``.
"""
import torch
import torch.nn as nn

from xla_fsdp import launch


def main(rank: int) -> dict:
    import torch_xla
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(16, 30), nn.GELU(), nn.Linear(30, 6)),
                 shard_param_on_dim_0=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16).to(torch_xla.device())
    model(x).square().mean().backward()
    opt.step()
    torch_xla.sync()
    shapes = {name: tuple(p.shape) for name, p in model.get_original_names_and_sharded_parameters()}
    return {"repr": model.extra_repr(), "shard_shapes": shapes}


if __name__ == "__main__":
    result = launch(main, num_devices=4)[0]
    print(result["repr"])
    for name, shape in result["shard_shapes"].items():
        print(f"  rank 0 holds {name}: {shape}")
