"""What a save writes, from the live model or from an ``UnwrappedState``.

From the live model's shards, each rank its own: per-rank files (``per_rank_files``:
``save_sharded``) and a DCP checkpoint's chunks (``dcp_shards``: ``save_dcp``). Both DCP
writers, this one and ``dcp_directory``, name, cut and commit their files alike
(``dcp_files``).

The consolidated formats, each streamed from an ``UnwrappedState`` (read from per-rank
files, ``per_rank.unwrapped``, or gathered from a live model, ``gathered_state``): one
``.pth`` or ``.safetensors`` file (``consolidated_file``), a DCP directory
(``dcp_directory``), a Hugging Face directory (``hf_directory``), and the choice among them
with the check of what was written (``formats``). ``save_consolidated`` and the
``consolidate`` tool both write through them."""
