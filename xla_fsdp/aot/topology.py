"""TPU slices by name, their chips' published figures, their links and their host VMs.
Pure: no jax, no torch.

A slice is named the way Google Cloud names it (``v5e-8``, ``v5litepod-8``, ``v6e-256``,
``v5p-8``) or by its chip grid (``v5e:2x4``, ``v5p:4x4x12``), which is what libtpu's
compile-only client takes. In a ``v5p-N`` name, N counts TensorCores (two per chip), as
Cloud TPU's accelerator types do; in ``v5e-N`` and ``v6e-N`` it counts chips.

Only the slice shapes Cloud TPU sells are known here: v5e and v6e from one chip to a 16x16
pod; v5p's small shapes and every shape of whole 4x4x4 cubes (each side a multiple of 4, as
Google's GKE tooling, xpk, generates them) up to 6,144 chips, Google's stated limit of one
v5p slice (https://cloud.google.com/tpu/docs/v5p). A grid libtpu would accept but no one
can rent is refused with the others, since a plan for it answers no question a user has.

[Note: links and wraparound] Each chip has one ICI link to each neighbour along each axis
of its grid (a 2-D torus of chips for v5e and v6e, 3-D for v5p). Along an axis whose far
ends are linked (a wraparound), the chips form a ring that carries data both ways; along
an axis without one they form a line, whose end chips bound a collective to one way.
v5e and v6e have wraparounds only on axes of 16 chips (a full pod side); v5p has them on
every axis of a slice made of whole 4x4x4 cubes (the optical switches close them), and on
none of a smaller one. The figures per link are the scaling book's (jax-ml/scaling-book,
"How to think about TPUs": one-way bytes per second per link); Google states the chip's
total, both ways over all links, which is the ``ici_bytes_per_s`` shown.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

SCALING_BOOK = "https://jax-ml.github.io/scaling-book/tpus/"


@dataclass(frozen=True)
class HostVm:
    """A TPU VM type: how many chips it hosts and its memory (``source`` states them)."""
    machine_type: str
    chips: int
    memory_bytes: int
    source: str


@dataclass(frozen=True)
class Chip:
    """A TPU generation's published per-chip figures (``source``: where they are stated).

    Bandwidths are in bytes per second. ``ici_bytes_per_s`` is Google's per-chip figure,
    both directions over all links together; ``ici_link_bytes_per_s`` is one link, one
    way (see [Note: links and wraparound])."""
    generation: str
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    ici_link_bytes_per_s: float
    dims: int                  # 2: a 2-D torus of chips (v5e, v6e); 3: a 3-D torus (v5p)
    source: str
    host_vms: Tuple[HostVm, ...] = ()


GIB = 2 ** 30
GB = 10 ** 9
_V5E_VMS = "https://cloud.google.com/tpu/docs/v5e (VM types)"
_V6E_VMS = ("Compute Engine's ct6e-standard-* machine types (176 / 720 / 1440 GB); "
            "https://cloud.google.com/tpu/docs/v6e states 1536 GiB of DRAM per 8-chip host")
CHIPS: Dict[str, Chip] = {
    "v5e": Chip("v5e", 16 * GIB, 197e12, 819e9, 400e9, 4.5e10, 2,
                "https://cloud.google.com/tpu/docs/v5e",
                (HostVm("ct5lp-hightpu-1t", 1, 48 * GB, _V5E_VMS),
                 HostVm("ct5lp-hightpu-4t", 4, 192 * GB, _V5E_VMS),
                 HostVm("ct5lp-hightpu-8t", 8, 384 * GB, _V5E_VMS))),
    "v6e": Chip("v6e", 32 * GIB, 918e12, 1640e9, 800e9, 9e10, 2,
                "https://cloud.google.com/tpu/docs/v6e",
                (HostVm("ct6e-standard-1t", 1, 176 * GB, _V6E_VMS),
                 HostVm("ct6e-standard-4t", 4, 720 * GB, _V6E_VMS),
                 HostVm("ct6e-standard-8t", 8, 1440 * GB, _V6E_VMS))),
    # 1,200 GB/s of ICI per chip, both ways over its six links
    "v5p": Chip("v5p", 95 * GIB, 459e12, 2765e9, 1200e9, 9e10, 3,
                "https://cloud.google.com/tpu/docs/v5p",
                (HostVm("ct5p-hightpu-4t", 4, 448 * GB,
                        "https://cloud.google.com/tpu/docs/v5p (VM types)"),)),
}


_V5P_MAX_CUBES = 96


def _v5p_grids() -> Tuple[Tuple[int, int, int], ...]:
    """v5p's small shapes, then every AxBxC of whole cubes (A <= B <= C, multiples of 4)
    up to 96 cubes (6,144 chips), by chip count."""
    cubes = [g for g in itertools.combinations_with_replacement(range(4, 385, 4), 3)
             if math.prod(d // 4 for d in g) <= _V5P_MAX_CUBES]
    return ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4)) + tuple(
        sorted(cubes, key=lambda g: (math.prod(g), g[2] - g[0], g)))


# The slice shapes Cloud TPU offers, by chip grid.
_SQUARE = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))
GRIDS: Dict[str, Tuple[Tuple[int, ...], ...]] = {"v5e": _SQUARE, "v6e": _SQUARE,
                                                  "v5p": _v5p_grids()}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v5e": "v5e", "v6e": "v6e",
           "trillium": "v6e", "v5p": "v5p"}
_CORES_PER_CHIP = {"v5e": 1, "v6e": 1, "v5p": 2}


@dataclass(frozen=True)
class Topology:
    """One TPU slice: its chip and its grid of chips."""
    chip: Chip
    grid: Tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.grid)

    @property
    def name(self) -> str:
        """The grid name libtpu compiles for, e.g. ``v5e:2x4``."""
        return f"{self.chip.generation}:{'x'.join(map(str, self.grid))}"

    @property
    def cloud_name(self) -> str:
        """Cloud TPU's accelerator type, e.g. ``v5e-8`` or ``v5p-8`` (TensorCores)."""
        gen = self.chip.generation
        return f"{gen}-{self.chips * _CORES_PER_CHIP[gen]}"

    def wraparound(self, axis: int) -> bool:
        """Whether the chips along ``axis`` form a ring (see [Note: links and
        wraparound])."""
        if self.chip.generation == "v5p":
            return all(d % 4 == 0 for d in self.grid)
        return self.grid[axis] == 16

    def host_vm(self) -> HostVm:
        """The VM type that hosts this slice's chips: the one VM of a slice that fits one,
        else the largest that hosts several."""
        vms = self.chip.host_vms
        single = [vm for vm in vms if vm.chips == self.chips]
        if single:
            return single[0]
        many = [vm for vm in vms if vm.chips == 4] or list(vms)
        return max(many, key=lambda vm: vm.chips)

    def coords(self, index: int) -> Tuple[int, ...]:
        """The grid position of chip ``index`` when chips are numbered with the first
        axis fastest (what libtpu reports for a slice of one host; the estimate uses the
        compiler's own positions when it has them)."""
        out = []
        for size in self.grid:
            out.append(index % size)
            index //= size
        return tuple(out)

    def larger(self) -> Optional["Topology"]:
        """The next slice of this generation with more chips (None after the largest)."""
        bigger = sorted((g for g in GRIDS[self.chip.generation]
                         if math.prod(g) > self.chips), key=math.prod)
        return Topology(self.chip, _preferred(bigger)) if bigger else None

    def __str__(self) -> str:
        return f"{self.cloud_name} ({self.name}, {self.chips} chip{'s' * (self.chips > 1)})"


def _preferred(grids: List[Tuple[int, ...]]) -> Tuple[int, ...]:
    """Of several grids, the one with fewest chips, and of those the closest to a cube:
    what a Cloud name ``v5p-N`` stands for when several grids have N / 2 chips, as
    Cloud's and xpk's default topologies are."""
    return min(grids, key=lambda g: (math.prod(g), max(g) - min(g), g))


def known_names(generation: Optional[str] = None) -> List[str]:
    """One line per chip count: the Cloud name, the grid name, the chips (v5p's other
    shapes of the same count are named by grid)."""
    out = []
    for gen, grids in GRIDS.items():
        if generation not in (None, gen):
            continue
        for count in sorted({math.prod(g) for g in grids}):
            t = Topology(CHIPS[gen], _preferred([g for g in grids if math.prod(g) == count]))
            out.append(f"{t.cloud_name} / {t.name} ({count} chip{'s' * (count > 1)})")
    return out


def aliases(generation: str) -> List[str]:
    """The names a generation answers to (``v5e``: ``v5litepod``, ``v5lite``)."""
    return [a for a, g in ALIASES.items() if g == generation]


def resolve(name: str) -> Topology:
    """The slice ``name`` stands for; ValueError listing the known slices otherwise."""
    text = name.strip().lower()
    grid_form = re.fullmatch(r"([a-z0-9]+)[:=_]((?:\d+x)+\d+)", text)
    cloud_form = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
    if grid_form:
        gen = ALIASES.get(grid_form.group(1))
        grid = tuple(int(d) for d in grid_form.group(2).split("x"))
        if gen is not None and grid in GRIDS[gen]:
            return Topology(CHIPS[gen], grid)
    elif cloud_form:
        gen = ALIASES.get(cloud_form.group(1))
        if gen is not None:
            count = int(cloud_form.group(2))
            grids = [g for g in GRIDS[gen] if math.prod(g) * _CORES_PER_CHIP[gen] == count]
            if grids:
                return Topology(CHIPS[gen], _preferred(grids))
    shown = [n.split(" (")[0] for n in known_names()
             if int(n.split("(")[1].split()[0]) <= 256]
    raise ValueError(f"unknown TPU topology {name!r}; known slices: " + ", ".join(shown)
                     + ", and larger v5p slices (grids AxBxC of whole 4x4x4 cubes, up to "
                       "6,144 chips); `python -m xla_fsdp.aot topologies` lists them all")
