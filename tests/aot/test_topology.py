"""TPU slices by name: Cloud's names and chip grids, and the refusal of anything else."""
import pytest

from xla_fsdp.aot.topology import known_names, resolve


@pytest.mark.parametrize("name, grid, chips, cloud", [
    ("v5e-8", "v5e:2x4", 8, "v5e-8"),
    ("v5litepod-8", "v5e:2x4", 8, "v5e-8"),
    ("v5e:2x4", "v5e:2x4", 8, "v5e-8"),
    ("V5E-1", "v5e:1x1", 1, "v5e-1"),
    ("v6e-256", "v6e:16x16", 256, "v6e-256"),
    ("v6e:8x16", "v6e:8x16", 128, "v6e-128"),
    ("v5p-8", "v5p:2x2x1", 4, "v5p-8"),          # v5p counts TensorCores: 4 chips
    ("v5p:4x8x8", "v5p:4x8x8", 256, "v5p-512"),
])
def test_names_resolve_to_slices(name, grid, chips, cloud):
    t = resolve(name)
    assert (t.name, t.chips, t.cloud_name) == (grid, chips, cloud)


def test_chips_carry_their_published_figures():
    v5e, v6e = resolve("v5e-8").chip, resolve("v6e-8").chip
    assert v5e.hbm_bytes == 16 * 2 ** 30 and v6e.hbm_bytes == 32 * 2 ** 30
    assert v5e.peak_bf16_flops == 197e12 and v6e.peak_bf16_flops == 918e12
    assert v5e.source.startswith("https://cloud.google.com/tpu/docs/")


@pytest.mark.parametrize("name", ["v4-8", "v5e-7", "v5e:3x3", "v5p-2", "tpu", "v6e:2x2x2", ""])
def test_unknown_slices_are_refused_with_the_known_ones(name):
    with pytest.raises(ValueError) as info:
        resolve(name)
    message = str(info.value)
    assert repr(name) in message and "v5e-8 / v5e:2x4" in message and "v6e-256" in message


def test_known_names_cover_one_to_256_chips_of_each_generation():
    names = known_names()
    for gen, smallest in (("v5e", "v5e-1"), ("v6e", "v6e-1"), ("v5p", "v5p-8")):
        mine = [n for n in names if n.startswith(gen)]
        assert mine[0].startswith(smallest) and resolve(mine[-1].split(" / ")[1]).chips == 256
