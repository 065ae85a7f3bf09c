"""TPU slices by name, and the published figures of their chips. Pure: no jax, no torch.

A slice is named the way Google Cloud names it (``v5e-8``, ``v5litepod-8``, ``v6e-256``,
``v5p-8``) or by its chip grid (``v5e:2x4``, ``v5p:2x2x1``), which is what libtpu's
compile-only client takes. In a ``v5p-N`` name, N counts TensorCores (two per chip), as
Cloud TPU's accelerator types do; in ``v5e-N`` and ``v6e-N`` it counts chips.

Only the slice shapes Cloud TPU sells are known here, from one chip to 256: a grid libtpu
would accept but no one can rent is refused with the others, since a plan for it answers no
question a user has.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class Chip:
    """A TPU generation's published per-chip figures (``source``: where they are stated).

    Bandwidths are in bytes per second. ``ici_bytes_per_s`` is the chip's bidirectional
    inter-chip interconnect bandwidth, all links together."""
    generation: str
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    dims: int                  # 2: a 2-D torus of chips (v5e, v6e); 3: a 3-D torus (v5p)
    source: str


GIB = 2 ** 30
CHIPS: Dict[str, Chip] = {
    "v5e": Chip("v5e", 16 * GIB, 197e12, 819e9, 400e9, 2,
                "https://cloud.google.com/tpu/docs/v5e"),
    "v6e": Chip("v6e", 32 * GIB, 918e12, 1638e9, 800e9, 2,
                "https://cloud.google.com/tpu/docs/v6e"),
    # 4,800 Gbps of ICI per chip
    "v5p": Chip("v5p", 95 * GIB, 459e12, 2765e9, 600e9, 3,
                "https://cloud.google.com/tpu/docs/v5p"),
}
# The slice shapes Cloud TPU offers, by chip grid.
GRIDS: Dict[str, Tuple[Tuple[int, ...], ...]] = {
    "v5e": ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16)),
    "v6e": ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16)),
    "v5p": ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4), (4, 4, 8), (4, 8, 8)),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v5e": "v5e", "v6e": "v6e", "trillium": "v6e",
            "v5p": "v5p"}
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

    def __str__(self) -> str:
        return f"{self.cloud_name} ({self.name}, {self.chips} chip{'s' * (self.chips > 1)})"


def known_names() -> List[str]:
    """Every name ``resolve`` takes, one per slice: the Cloud name, then the grid name."""
    out = []
    for gen, grids in GRIDS.items():
        for grid in grids:
            t = Topology(CHIPS[gen], grid)
            out.append(f"{t.cloud_name} / {t.name}")
    return out


def resolve(name: str) -> Topology:
    """The slice ``name`` stands for; ValueError listing the known slices otherwise."""
    text = name.strip().lower()
    grid_form = re.fullmatch(r"([a-z0-9]+)[:=_]((?:\d+x)+\d+)", text)
    cloud_form = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
    if grid_form:
        gen = _ALIASES.get(grid_form.group(1))
        grid = tuple(int(d) for d in grid_form.group(2).split("x"))
        if gen is not None and grid in GRIDS[gen]:
            return Topology(CHIPS[gen], grid)
    elif cloud_form:
        gen = _ALIASES.get(cloud_form.group(1))
        if gen is not None:
            count = int(cloud_form.group(2))
            for grid in GRIDS[gen]:
                if math.prod(grid) * _CORES_PER_CHIP[gen] == count:
                    return Topology(CHIPS[gen], grid)
    raise ValueError(f"unknown TPU topology {name!r}; known slices: "
                     + ", ".join(known_names()))
