"""One FSDP unit at run time: its state and hooks (``unit_state``), what the units of a model
share (``root_context``), its parameters' shard groups and records, gathering, freeing and
reducing them (``unit_params``), its buffers, its options, attention inside it
(``attention``), and the optimizer guard and other process-wide effects
installed when the first unit is built."""
