"""The machinery of ``ScannedLayers``: one layer traced once into forward and backward graphs
(``trace``), the two XLA while loops that run them over stacked shards (``loop``), and what a
stack must satisfy to be run that way (``checks``)."""
