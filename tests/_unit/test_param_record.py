"""ParamRecord on its own: its two transitions on the eager path (install, free: the one swap
of a placeholder's ``.data``) and on the traced one (lend, take_back), its trainability, its
gradient hook, and finding names and placeholders. No XLA."""
import torch
import torch.nn as nn
from torch.testing import assert_close

from tests.support.fake_collectives import FakeWorld
from xla_fsdp._unit.param_record import ParamRecord, placeholders_in, taken_name
from ..support.checks import every, nonempty, pairs


class Tied(nn.Module):
    """An embedding whose weight the head shares (and the forward reads once more), and a
    layer of its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.layer = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(self.layer(x)) + self.embed.weight.sum()


def records_of(world, rank=0):
    return [r for g in world.shard_groups[rank] for r in g.records]


def full_values(world):
    return [p.detach().clone() for p in world.reference.parameters()]


def test_install_puts_full_values_in_and_free_puts_dummies_back():
    world = FakeWorld(Tied(), world_size=1)
    records = records_of(world)
    placeholders = [r.placeholder for r in records]
    versions = [p._version for p in placeholders]
    values = full_values(world)
    ParamRecord.install(records, values)
    for r, p, v in pairs(records, placeholders, values):
        assert r.placeholder is p and torch.equal(p, v) and p.data_ptr() == v.data_ptr()
        assert r.holds_full and p._has_full_param
    assert [p._version for p in placeholders] == versions

    dummy = torch.zeros(1)
    assert ParamRecord.free(records, [dummy] * len(records))
    for r, p in pairs(records, placeholders):
        assert r.placeholder is p and p.data_ptr() == dummy.data_ptr()
        assert not r.holds_full and not p._has_full_param
    assert [p._version for p in placeholders] == versions
    assert not ParamRecord.free(records, [torch.ones(1)] * len(records))  # nothing held
    assert every(p.data_ptr() == dummy.data_ptr() for p in placeholders)


def test_a_write_to_a_freed_placeholder_is_refused_at_the_next_install():
    """[Note: writes to a freed placeholder]: a clamp through the module's attribute between
    forwards would be lost; the next install names the parameter instead."""
    import pytest
    world = FakeWorld(Tied(), world_size=1)
    records = records_of(world)
    ParamRecord.install(records, full_values(world))
    ParamRecord.free(records, [torch.zeros(1)] * len(records))
    weight = world.modules[0].layer.weight
    with torch.no_grad():
        # refused where it happens ([Note: a freed placeholder is empty])...
        with pytest.raises(RuntimeError, match=r"clamp_\(\) read parameter 'layer.weight' of "
                                               r"the FSDP unit around Tied outside"):
            weight.clamp_(-0.1, 0.1)
        # ...and a write that passed no check (here with the check off) at the next install
        with torch._C.DisableTorchFunctionSubclass():
            weight.clamp_(-0.1, 0.1)
    with pytest.raises(RuntimeError, match=r"parameter 'layer.weight' was changed in place "
                                           r"through its module attribute"):
        ParamRecord.install(records, full_values(world))


def test_a_write_to_a_held_full_value_is_refused_when_it_is_freed():
    """[Note: writes to a held full value]: the gathered copy is dropped, so a write to it is
    refused after every placeholder is freed, unless the caller keeps the writes."""
    import pytest
    world = FakeWorld(Tied(), world_size=1)
    records = records_of(world)
    ParamRecord.install(records, full_values(world))
    with torch.no_grad():
        world.modules[0].layer.weight.clamp_(-0.1, 0.1)   # a forward's write: lost
    with pytest.raises(RuntimeError, match=r"parameter 'layer.weight' was changed in place "
                                           r"while the unit held its full value"):
        ParamRecord.free(records, [torch.zeros(1)] * len(records))
    assert every((not r.holds_full for r in records), "records")   # freed all the same
    ParamRecord.install(records, full_values(world))   # and the next install goes on
    with torch.no_grad():
        world.modules[0].layer.weight.mul_(2.0)
    assert ParamRecord.free(records, [torch.zeros(1)] * len(records), writes_kept=True)


def test_free_swaps_only_the_placeholders_that_hold_full_values():
    world = FakeWorld(Tied(), world_size=1)
    held, *others = records_of(world)
    before = [r.placeholder.data_ptr() for r in others]
    ParamRecord.install([held], full_values(world)[:1])
    assert ParamRecord.free([held, *others], [torch.full((1,), 7.0)] * 3)
    with torch._C.DisableTorchFunctionSubclass():   # a freed placeholder refuses reads
        assert held.placeholder.tolist() == [7.0]
    assert [r.placeholder.data_ptr() for r in others] == before


def test_a_forward_survives_free_and_install_before_its_backward():
    # resharding after forward and gathering again for backward: autograd saved the
    # placeholders, and reads the values installed again
    world = FakeWorld(Tied(), world_size=1)
    records, module = records_of(world), world.modules[0]
    ParamRecord.install(records, full_values(world))
    x = torch.randn(4, 3, requires_grad=True)
    out = module(x)
    ParamRecord.free(records, [torch.zeros(1)] * len(records))
    ParamRecord.install(records, full_values(world))  # new tensors, the same values
    out.pow(2).sum().backward()

    ref_x = x.detach().clone().requires_grad_(True)
    world.reference(ref_x).pow(2).sum().backward()
    assert_close(x.grad, ref_x.grad)
    for r, p in pairs(records, world.reference.parameters()):
        assert_close(r.placeholder.grad, p.grad)


def test_lend_sets_the_full_values_in_every_holder_and_take_back_the_placeholders():
    # the traced path: the modules read the graph's values, the placeholders stay untouched
    world = FakeWorld(Tied(), world_size=1)
    records, module = records_of(world), world.modules[0]
    values = full_values(world)
    data = [r.placeholder.data_ptr() for r in records]
    embed = records[0]
    assert len(embed.owners) == 2   # the embedding's and the head's attribute
    ParamRecord.lend(records, values)
    for r, v in pairs(records, values):
        assert every(getattr(m, a) is v for m, a in r.owners)
        assert not r.holds_full
    x = torch.randn(4, 3)
    assert_close(module(x), world.reference(x))
    ParamRecord.take_back(records)
    for r in nonempty(records, "records"):
        assert every(getattr(m, a) is r.placeholder for m, a in r.owners)
    assert [r.placeholder.data_ptr() for r in records] == data


def test_agree_requires_grad_freezes_and_unfreezes_the_placeholder():
    world = FakeWorld(Tied(), world_size=1)
    record = records_of(world)[0]
    ParamRecord.install([record], full_values(world)[:1])
    record.placeholder.grad = torch.ones_like(record.placeholder)
    record.agree_requires_grad(False)
    assert not record.placeholder.requires_grad and not record.requires_grad
    assert record.placeholder.grad is None     # a frozen placeholder keeps no gradient
    record.agree_requires_grad(True)
    assert record.placeholder.requires_grad and record.requires_grad
    assert record.placeholder.grad is None


def test_the_gradient_hook_is_registered_once_and_runs_after_every_accumulation():
    world = FakeWorld(Tied(), world_size=1)
    records, module = records_of(world), world.modules[0]
    embed, weight, bias = records
    calls = {id(r): 0 for r in records}

    def count(record):
        calls[id(record)] += 1

    weight.agree_requires_grad(False)
    for r in records:
        r.hook_gradient(lambda r=r: count(r))
    assert weight.grad_hook is None           # frozen: nothing to hook
    embed.hook_gradient(lambda: count(embed))  # a second registration adds nothing
    hook = embed.grad_hook

    ParamRecord.install(records, full_values(world))
    for _ in range(2):
        module(torch.randn(4, 3)).sum().backward()
    # the tied weight is used twice per forward: autograd accumulates it once
    assert calls == {id(embed): 2, id(weight): 0, id(bias): 2}

    weight.agree_requires_grad(True)
    weight.hook_gradient(lambda: count(weight))
    embed.hook_gradient(lambda: count(embed))
    assert weight.grad_hook is not None and embed.grad_hook is hook
    module(torch.randn(4, 3)).sum().backward()
    assert calls == {id(embed): 3, id(weight): 1, id(bias): 3}


def test_taken_name_is_the_canonical_name_of_a_parameter_or_its_placeholder():
    world = FakeWorld(Tied(), world_size=1)
    (embed, embed_owners, embed_names), (layer_w, _, _), (layer_b, _, _) = world.found[0]
    assert embed_names == ["embed.weight", "head.weight"] and len(embed_owners) == 2
    records = records_of(world)
    assert [r.names for r in records] == [["embed.weight", "head.weight"], ["layer.weight"],
                                          ["layer.bias"]]
    assert taken_name(embed) == taken_name(records[0].placeholder) == "embed.weight"
    assert taken_name(layer_w) == "layer.weight" and taken_name(layer_b) == "layer.bias"
    assert taken_name(records[2].placeholder) == "layer.bias"
    # [Note: a taken parameter is empty]: what else holds an original reads nothing stale,
    # and a reduction over it (a sum was 0) is refused, naming it
    assert every((p.numel() == 0 for p, _, _ in world.found[0]), "originals")
    import pytest
    with pytest.raises(RuntimeError, match=r"sum\(\) read the original parameter 'layer.bias' "
                                           r"of the unit around Tied, which the unit replaced"):
        layer_b.sum()
    # never taken: an unwrapped model's parameter, a shard, any tensor
    assert taken_name(world.reference.embed.weight) is None
    assert taken_name(world.shard_groups[0][0].shard) is None
    assert taken_name(torch.zeros(1)) is None


def test_placeholders_in_lists_each_placeholder_a_module_holds_once():
    world = FakeWorld(Tied(), world_size=1)
    module = world.modules[0]
    embed, weight, bias = [r.placeholder for r in records_of(world)]
    assert module.embed.weight is module.head.weight is embed
    assert [id(t) for t in placeholders_in(module)] == [id(embed), id(weight), id(bias)]
    assert [id(t) for t in placeholders_in(module.head)] == [id(embed)]
    assert [id(t) for t in placeholders_in(module.layer)] == [id(weight), id(bias)]
    assert placeholders_in(world.reference) == []  # parameters, not placeholders
    module.layer.extra = torch.zeros(2)              # a plain tensor attribute
    assert len(placeholders_in(module)) == 3


def test_a_module_holding_placeholders_is_not_copied_or_pickled():
    """[Note: a unit is not copied], one level down: a copy of a module inside a unit (an
    EMA of one block) would hold empty placeholders; so would a module above it."""
    import copy
    import io
    import pytest
    world = FakeWorld(Tied(), world_size=1)
    module = world.modules[0]
    for target in (module.layer, module):
        for copier in (copy.deepcopy, lambda m: torch.save(m, io.BytesIO())):
            with pytest.raises(TypeError, match=r"holds parameters that the FSDP unit around "
                                                r"Tied shards: a copy or a pickle of it"):
                copier(target)


def test_a_frozen_original_keeps_its_value():
    """[Note: a taken parameter is empty]: frozen, what else holds it reads a right value."""
    model = Tied()
    model.layer.bias.requires_grad_(False)
    bias = model.layer.bias
    value = bias.detach().clone()
    FakeWorld(model, world_size=1)
    assert torch.equal(bias.detach(), value)


def test_a_module_holding_placeholders_refuses_a_state_dict_of_its_own():
    """[Note: state_dict() below a unit]: the dict would lack every parameter the unit holds;
    through a unit's state_dict() (which counts itself) the same module is read."""
    import pytest
    from xla_fsdp._unit.param_record import unit_state_dict
    module = FakeWorld(Tied(), world_size=1).modules[0]
    with pytest.raises(TypeError, match=r"state_dict\(\) of a module inside an FSDP unit: "
                                        r"Linear holds parameters that the FSDP unit around "
                                        r"Tied shards, and the state dict would leave"):
        module.layer.state_dict()
    with pytest.raises(TypeError, match=r"Embedding holds .* \(at 'embed' in the module "
                                        r"called\)"):
        module.state_dict()                     # a module above it: refused where it reads
    with unit_state_dict():
        assert list(module.state_dict()) == []   # placeholders are not torch's parameters
    with pytest.raises(TypeError, match="inside an FSDP unit"):
        module.state_dict()                      # the count went back down


def test_a_freed_placeholder_refuses_reads_of_its_values_and_passes_its_metadata():
    """[Note: a freed placeholder is empty]: a sum over it was 0; through ``.data`` or a
    view too; what reads only its metadata (``new_zeros`` for a hidden state) passes."""
    import pytest
    weight = FakeWorld(Tied(), world_size=1).modules[0].layer.weight
    for read in (weight.sum, lambda: weight.data.sum(), lambda: weight.T,
                 lambda: weight.data.normal_()):   # the last, an init outside apply(): lost
        with pytest.raises(RuntimeError, match=r"read parameter 'layer.weight' of the FSDP "
                                               r"unit around Tied outside the unit's forward"):
            read()
    assert weight.shape == (0,) and weight.dtype == torch.float32 and weight.grad is None
    assert weight.new_zeros(2).shape == (2,) and torch.numel(weight) == 0
