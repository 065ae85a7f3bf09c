import torch
from xla_fsdp import launch

def work(rank):
    import torch_xla, torch_xla.core.xla_model as xm
    from xla_fsdp._xla.private_api import functional_reduce_scatter
    d = torch_xla.device()
    g = (torch.arange(16.0).reshape(8, 2) * (rank + 1)).to(d)
    a = functional_reduce_scatter(g, 2)
    b = xm.reduce_scatter(xm.REDUCE_SUM, g, scale=1.0, scatter_dim=0, shard_count=2, groups=None, pin_layout=False)
    hlo_a = torch_xla._XLAC._get_xla_tensors_hlo([a])
    hlo_b = torch_xla._XLAC._get_xla_tensors_hlo([b])
    torch_xla.sync()
    return a.cpu().tolist(), b.cpu().tolist(), [l for l in hlo_a.splitlines() if "add(" in l or "reduce-scatter" in l], [l for l in hlo_b.splitlines() if " add(" in l or "reduce-scatter" in l]

if __name__ == "__main__":
    out = launch(work, (), num_devices=2)
    for r, (a, b, ha, hb) in out.items():
        print(r, a == b, a)
        print("functional:", *ha, sep="\n  ")
        print("xm:", *hb, sep="\n  ")
