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


def _status(field: str) -> int:
    import re
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def reset_peak() -> int:
    """Returns memory to the system (garbage collector, ``malloc_trim``), resets the kernel's
    high-water mark (``VmHWM``, by writing 5 to ``/proc/self/clear_refs``) and returns the
    resident set now: what ``peak_added`` measures from."""
    import ctypes
    import gc
    gc.collect()  # what an earlier run left in reference cycles
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak_added(before: int) -> int:
    """The process's peak resident set since ``reset_peak``, less what it was then."""
    return _status("VmHWM") - before
