"""What each checkpoint format is, apart from reading and writing it: the keys every
format files its state under (``keys``), per-rank files' names, shard metadata and record
(``per_rank``), the consolidated outputs' names (``consolidated``), and DCP's layout,
planners and ``.metadata`` (``dcp``), whose keys are also the language every source speaks
to the staging loader."""
