"""Where a load reads from, each as a ``staging.Source``: a DCP directory (``dcp_files``),
one checkpoint's per-rank files at any world size (``per_rank_files``), consolidated ``.pth``
and safetensors files, Hugging Face directories and state dicts in memory
(``consolidated_files``), and any of these read by the first rank alone and sent to the others
over the collectives (``first_rank``). All but DCP's describe their tensors through
``entries``."""
