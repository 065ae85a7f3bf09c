"""Checkpoints other than DCP directories as the loader reads them (``dcp.staging.Source``):
consolidated ``.pth`` files, safetensors files, Hugging Face directories and state dicts in
memory (``consolidated_files``, over ``entries``), and any source read by the first rank
alone and sent to the others over the collectives (``first_rank``). Per-rank files are read
through ``entries`` too, by ``consolidate.per_rank_source``, beside the layout arithmetic
they are read by (this package does not import ``consolidate``)."""
