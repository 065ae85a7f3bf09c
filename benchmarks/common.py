"""What the memory benchmarks share: their command line."""
import argparse
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def size_args(result_name: str) -> argparse.Namespace:
    """``--gb`` (model size), ``--world`` (ranks), ``--repeats`` and ``--out`` (the results
    file, by default ``benchmarks/results/<result_name>``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(RESULTS, result_name))
    return ap.parse_args()


def write_result(path: str, lines: list) -> None:
    """Prints the results and writes them to ``path``."""
    text = "\n".join(lines) + "\n"
    print(text)
    with open(path, "w") as f:
        f.write(text)
