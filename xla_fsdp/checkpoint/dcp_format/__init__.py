"""DCP's format as every reader and writer of ours speaks it: the keys and slots of the layout
PyTorch FSDP2 and torchtitan use (``layout``), the planners that hand DCP our chunks and take
them back (``planners``), how a save's files are named, cut and committed (``files``), and a
directory's ``.metadata`` read without unpickling anything it names (``metadata_file``). The
staging loader and every source are built on it; ``save_dcp`` and ``load_dcp`` (``dcp``)
above them."""
