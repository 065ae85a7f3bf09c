"""``python -m torch_xla.distributed.fsdp.consolidate_sharded_ckpts``, on xla_fsdp's tool,
with torch_xla's defaults (``--ckpt_suffix '*.pth'``; the output is never read as an input)."""
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from xla_fsdp.checkpoint.consolidate.cli import main as consolidate_main
    return consolidate_main(argv, torch_xla_defaults=True)


if __name__ == "__main__":
    raise SystemExit(main())
