"""The names a consolidated checkpoint is read by, written by ``writers`` and read by
``sources``: the keys of a consolidated ``.pth`` (torch_xla's consolidation writes
``model``; the optimizer and ``extra`` are ours), the optimizer file beside a
``.safetensors``, and a Hugging Face directory's weight files."""
from __future__ import annotations

import os

# a consolidated .pth holds a per-rank file's ``MODEL``, ``OPTIMIZER`` and ``EXTRA``
# (``formats.per_rank``: the unwrapped model's state dict, its optimizer's, what the training
# code saved) and the optimizer's parameter names by index under this key
OPTIMIZER_NAMES = "optimizer_param_names"
# a Hugging Face directory's weights: one file, or shards listed by an index
HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"


def optimizer_companion(safetensors_path: str) -> str:
    """The file beside a consolidated ``.safetensors`` that holds its optimizer state (the
    keys above but ``MODEL``)."""
    return os.path.splitext(safetensors_path)[0] + ".optimizer.pth"
