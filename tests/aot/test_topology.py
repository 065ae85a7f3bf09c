"""TPU slices by name: Cloud's names and chip grids, the slices Google sells, their links
and host VMs, and the refusal of anything else."""
import pytest

from xla_fsdp.aot.topology import known_names, resolve


@pytest.mark.parametrize("name, grid, chips, cloud", [
    ("v5e-8", "v5e:2x4", 8, "v5e-8"),
    ("v5litepod-8", "v5e:2x4", 8, "v5e-8"),
    ("v5e:2x4", "v5e:2x4", 8, "v5e-8"),
    ("V5E-1", "v5e:1x1", 1, "v5e-1"),
    ("v6e-256", "v6e:16x16", 256, "v6e-256"),
    ("v6e:8x16", "v6e:8x16", 128, "v6e-128"),
    ("trillium-4", "v6e:2x2", 4, "v6e-4"),
    ("v5p-8", "v5p:2x2x1", 4, "v5p-8"),          # v5p counts TensorCores: 4 chips
    ("v5p:4x8x8", "v5p:4x8x8", 256, "v5p-512"),
    ("v5p-384", "v5p:4x4x12", 192, "v5p-384"),   # sold; three cubes in a row
    ("v5p-12288", "v5p:16x16x24", 6144, "v5p-12288"),   # the largest single slice
    ("v5p:4x8x12", "v5p:4x8x12", 384, "v5p-768"),
])
def test_names_resolve_to_slices(name, grid, chips, cloud):
    t = resolve(name)
    assert (t.name, t.chips, t.cloud_name) == (grid, chips, cloud)


def test_chips_carry_their_published_figures():
    v5e, v6e, v5p = (resolve(n).chip for n in ("v5e-8", "v6e-8", "v5p-8"))
    assert v5e.hbm_bytes == 16 * 2 ** 30 and v6e.hbm_bytes == 32 * 2 ** 30
    assert v5e.peak_bf16_flops == 197e12 and v6e.peak_bf16_flops == 918e12
    assert v5p.ici_bytes_per_s == 1200e9                  # Google's v5p page
    assert (v5e.ici_link_bytes_per_s, v6e.ici_link_bytes_per_s,
            v5p.ici_link_bytes_per_s) == (4.5e10, 9e10, 9e10)   # the scaling book's
    assert v5e.source.startswith("https://cloud.google.com/tpu/docs/")


def test_host_vms_and_the_next_slice():
    assert resolve("v6e-8").host_vm().machine_type == "ct6e-standard-8t"
    assert resolve("v6e-64").host_vm().machine_type == "ct6e-standard-4t"
    assert resolve("v5p-128").host_vm().chips == 4
    assert resolve("v5e-8").larger().cloud_name == "v5e-16"
    assert resolve("v5p-128").larger().name == "v5p:4x4x8"
    assert resolve("v6e-256").larger() is None


@pytest.mark.parametrize("name", ["v4-8", "v5e-7", "v5e:3x3", "v5p-2", "tpu", "v6e:2x2x2", "",
                                  "v5p:4x4x6", "v5p-20000"])
def test_unknown_slices_are_refused_with_the_known_ones(name):
    with pytest.raises(ValueError) as info:
        resolve(name)
    message = str(info.value)
    assert repr(name) in message and "v5e-8 / v5e:2x4" in message and "v6e-256" in message
    assert "topologies" in message


def test_known_names_give_each_chip_count_its_grid():
    names = known_names()
    for gen, smallest, largest in (("v5e", "v5e-1", 256), ("v6e", "v6e-1", 256),
                                   ("v5p", "v5p-8", 6144)):
        mine = [n for n in names if n.startswith(gen)]
        assert mine[0].startswith(smallest)
        assert resolve(mine[-1].split(" / ")[1].split(" (")[0]).chips == largest
    assert "v5e-8 / v5e:2x4 (8 chips)" in names
