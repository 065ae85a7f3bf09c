"""What the tests share, and nothing else: models and their data (``models``), the parity
settings and their comparison (``parity``), reading traced HLO (``hlo``), the pattern
scenarios and their harness, the Hugging Face architectures, checkpoint workloads and
synthetic checkpoint files. Test modules import from here, never from each other."""
