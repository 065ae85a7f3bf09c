"""Sharding arithmetic and collectives: how tensors are cut across ranks, how names in a wrapped
model map to the unwrapped one, how nested containers of tensors are walked, and the XLA
collectives. Pure tensor code: no modules, no hooks, no state."""
