"""torch_xla's FSDP surface on xla_fsdp: ``patch_torch_xla()`` and the package it installs as
``torch_xla.distributed.fsdp`` (``torch_xla_fsdp``), for code that imports torch_xla's FSDP
itself (Hugging Face Trainer, Lightning Fabric, torch_xla's own scripts)."""
