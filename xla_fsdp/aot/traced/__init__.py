"""The traced process of ``xla_fsdp.aot``: a training function run as one rank that stands
for the whole slice, its steps traced and never executed. Like the virtual launcher, it
patches torch_xla's entry points of its own, in its own process only."""
