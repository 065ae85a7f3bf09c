"""Finding tensors in what modules take and return (no XLA)."""
import dataclasses

import torch

from xla_fsdp._sharding.tensor_tree import collect_tensors, map_tensors

from ..support.models import Carrier


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: list


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: torch.Tensor


def test_tensors_in_dataclasses_and_plain_objects_are_found_and_replaced():
    a, b, c, d = (torch.ones(1) * i for i in range(4))
    out = Out(a, [b])
    assert map_tensors(lambda t: t + 10, out) is out and out.logits.item() == 10
    assert out.extra[0].item() == 11
    frozen = map_tensors(lambda t: t + 10, Frozen(c))
    assert isinstance(frozen, Frozen) and frozen.value.item() == 12
    carrier = map_tensors(lambda t: t + 10, Carrier(d))
    assert carrier.hidden.item() == 13
    assert [t.item() for t in collect_tensors((Out(a, [b]), {"k": c}))] == [0, 1, 2]


def test_inputs_are_collected_where_outputs_are_hooked():
    """One walk for both: a tensor that an output hook would reach (inside a plain object,
    a named tuple, a frozen dataclass) is also collected from an input."""
    a, b, c = (torch.ones(1) * i for i in range(3))
    found = collect_tensors(([Carrier(a)], Frozen(b), {"x": (c, c)}))
    assert [t.item() for t in found] == [0, 1, 2]
    hooked = []
    map_tensors(lambda t: hooked.append(t) or t, ([Carrier(a)], Frozen(b), {"x": (c, c)}))
    assert [id(t) for t in found] == list(dict.fromkeys(id(t) for t in hooked))


def test_the_input_cast_leaves_the_callers_objects_as_they_are():
    """A batch given to a low-precision unit (a ``UserDict`` as Hugging Face's
    ``BatchEncoding``, a dataclass, a plain object) keeps its float32 tensors for the
    caller; an object with nothing to cast (a cache the module updates) is passed itself."""
    import collections
    from xla_fsdp._sharding.tensor_tree import cast_floating
    batch = collections.UserDict(x=torch.ones(2), ids=torch.zeros(2, dtype=torch.long))
    out = Out(torch.ones(2), [torch.ones(2)])
    carrier = Carrier(torch.ones(2))
    cast = cast_floating(torch.bfloat16, (batch, out, carrier))
    assert [t.dtype for t in collect_tensors(cast)] == [torch.bfloat16, torch.int64] + \
        [torch.bfloat16] * 3
    assert [t.dtype for t in collect_tensors((batch, out, carrier))] == [torch.float32,
                                                                       torch.int64] + \
        [torch.float32] * 3
    assert type(cast[0]) is collections.UserDict and isinstance(cast[1], Out)
    cache = Carrier(torch.ones(2, dtype=torch.bfloat16))
    cache.keys = [torch.ones(1, dtype=torch.bfloat16)]
    kept = cache.keys
    assert cast_floating(torch.bfloat16, (cache,))[0] is cache and cache.keys is kept


def test_the_input_cast_saturates_finite_values():
    """[Note: casting without overflow]: a float32 mask's minimum stays finite in bf16, and
    -1e9 in float16; infinities and NaN stay."""
    from xla_fsdp._sharding.tensor_tree import cast_floating
    f32 = torch.finfo(torch.float32)
    values = torch.tensor([f32.min, f32.max, -1e9, float("-inf"), float("nan"), 1.5])
    for dtype in (torch.bfloat16, torch.float16):
        info = torch.finfo(dtype)
        cast = cast_floating(dtype, values)
        assert cast.dtype == dtype
        assert cast[:2].tolist() == [info.min, info.max]
        assert torch.isfinite(cast[2]) and (dtype == torch.bfloat16 or cast[2] == info.min)
        assert cast[3].item() == float("-inf") and cast[4].isnan() and cast[5].item() == 1.5
    assert cast_floating(torch.float32, values.to(torch.bfloat16)).dtype == torch.float32
