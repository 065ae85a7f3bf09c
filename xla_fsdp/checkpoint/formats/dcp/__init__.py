"""DCP's format as every reader and writer of ours speaks it: the keys and slots of the layout
PyTorch FSDP2 and torchtitan use (``layout``), the planners that hand DCP our chunks and take
them back (``planners``), and a directory's ``.metadata`` read without unpickling anything
it names (``metadata_file``). The staging loader, every source and the DCP writers
(``writers.dcp_shards``, ``writers.dcp_directory``, which write their files through
``writers.dcp_files``) are built on it."""
