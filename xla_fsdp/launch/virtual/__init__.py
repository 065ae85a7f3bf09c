"""Virtual XLA:CPU devices: N devices as N threads of one process (used by ``launch``)."""
