"""One checkpoint's per-rank files, as every reader of them sees them: which files make the set
and whether it is complete (``shard_set``), where each element of every unwrapped tensor lies
among them (``plan``), and what the optimizer's state in them is (``optimizer``). A live
model's shards, gathered over the collectives, stand in for the files from training code
(``live_model``)."""
