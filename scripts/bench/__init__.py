"""Training-step benchmark: xla_fsdp against torch_xla's FSDP and SPMD FSDPv2.

Run from the repository root::

    python -m scripts.bench [--devices 4 8] [--repeats 3] [--steps 8]   # the side-by-side table
    python -m scripts.bench.depth [--depths 4 16 64]                     # the depth sweep
    python -m scripts.bench.step_phases [unwrapped xla_fsdp torch_xla]  # host time per phase
    python -m scripts.bench.host_scale [--depths 8 32 64]               # host overhead by depth

Modules, each importing only those above it in this list:

- ``model``: the configuration, the GPT, its batches, the settings and how each competitor
  wraps the model;
- ``hlo``: reading the step graph's HLO (collectives, bytes moved) and XLA's memory
  statistics, and the marks a run leaves to find them;
- ``train``: the training loop and its timings, and one rank's run under ``xla_fsdp.launch``;
- ``spmd``: torch_xla's SPMD FSDPv2 as a competitor, in a process of its own;
- ``measure``: fresh processes, repetitions, crashes, analytic bounds and the summary of a
  setting;
- ``report``: the markdown table and chart of the results;
- ``__main__``, ``depth``, ``step_phases``, ``host_scale``: the command lines
  (``host_scale`` runs ``step_phases``' interleaved steps at each depth).
"""
