"""``private_api.to_cpu``: one transfer that keeps the containers' types, and what it means
for a per-rank checkpoint of an optimizer whose settings hold tuples (one launch at N = 1)."""
import collections

import torch

from xla_fsdp import launch

Pair = collections.namedtuple("Pair", "tensor number")


class Holder:
    def __init__(self, value):
        self.value = value


def _copies(rank, directory):
    import torch_xla
    from xla_fsdp import FSDP
    from xla_fsdp._xla.private_api import to_cpu
    from xla_fsdp.checkpoint import load_sharded, save_sharded
    device = torch_xla.device()
    held = torch.arange(3.0, device=device) * 2
    tree = {"pair": Pair(held, 1), "betas": (0.9, 0.99), "again": held,
            "ordered": collections.OrderedDict(x=[held]), "host": torch.ones(1)}
    looped = [held]
    looped.append(looped)
    deep = {"two_deep": Holder(Holder(held)), "key": {held: 1}, "looped": looped}
    tree["deep"] = deep
    out = to_cpu(tree)
    deep_out = out.pop("deep")
    inner = [deep_out["two_deep"].value.value, next(iter(deep_out["key"])),
             deep_out["looped"][0]]
    model = FSDP(torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(2, 4, device=device)).sum().backward()
    opt.step()
    torch_xla.sync()
    path = save_sharded(f"{directory}/ck", model, opt)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    load_sharded(f"{directory}/ck", model, fresh)
    return {"out": out, "host_kept": out["host"] is tree["host"],
            "one_copy": out["pair"].tensor is out["again"] is out["ordered"]["x"][0],
            "deep_on_cpu": [t.device.type for t in inner],
            "loop_kept": deep_out["looped"][1] is deep_out["looped"],
            "caller_unchanged": deep["two_deep"].value.value is held,
            "saved": torch.load(path, weights_only=False)["optimizer"]["param_groups"],
            "loaded": fresh.param_groups[0]["betas"]}


def test_containers_keep_their_types_and_a_tensor_held_twice_is_copied_once(tmp_path):
    got = launch(_copies, (str(tmp_path),), num_devices=1)[0]
    out = got["out"]
    assert type(out["pair"]) is Pair and out["pair"].number == 1
    assert type(out["betas"]) is tuple and type(out["ordered"]) is collections.OrderedDict
    assert out["pair"].tensor.device.type == "cpu"
    assert got["one_copy"] and got["host_kept"]
    # however deep, under a dict key, and in a list holding itself (torch_xla's walk)
    assert got["deep_on_cpu"] == ["cpu"] * 3 and got["loop_kept"] and got["caller_unchanged"]
    assert torch.equal(out["again"], torch.tensor([0.0, 2.0, 4.0]))
    # an AdamW saved and loaded again keeps its betas a tuple, as torch.save does
    assert [type(g["betas"]) for g in got["saved"]] == [tuple], got["saved"]
    assert got["loaded"] == (0.8, 0.9) and type(got["loaded"]) is tuple
