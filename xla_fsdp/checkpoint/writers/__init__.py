"""The consolidated checkpoint's writers, streamed from a per-rank plan (``per_rank``): one
``.pth`` or ``.safetensors`` file (``consolidated_file``), a DCP directory (``dcp_directory``),
a Hugging Face directory (``hf_directory``), and the choice among them with the check of what
was written (``formats``). ``save_consolidated`` and the ``consolidate`` tool both write
through them; from training code a live model's shards, gathered over the collectives, stand
in for the per-rank files (``per_rank.live_model``)."""
