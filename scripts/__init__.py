"""The project's benchmark and diagnostic scripts, run from the repository root with python -m."""
