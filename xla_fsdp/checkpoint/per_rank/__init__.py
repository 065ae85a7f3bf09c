"""One checkpoint's per-rank files, as every reader of them sees them: which files make the set
and whether it is complete (``shard_set``), where each element of every unwrapped tensor lies
among them (``plan``), what the optimizer's state in them is (``optimizer``), and the whole of
it as the consolidated writers read it (``unwrapped``)."""
