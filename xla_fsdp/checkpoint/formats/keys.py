"""The top-level keys every checkpoint format files a training state under: a per-rank file's
tree (torch_xla's ``{'model', 'optimizer', ...}``), a consolidated file's, and the first
component of a DCP checkpoint's keys. One name each, so that a reader of one format and a
writer of another agree without importing each other."""

MODEL, OPTIMIZER, EXTRA = "model", "optimizer", "extra"
