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


def step_parser(result_name: str) -> argparse.ArgumentParser:
    """The training benchmarks' command line: ``--world``, ``--repeats``, ``--steps``,
    ``--layers``, ``--dim`` (the benchmark's GPT) and ``--out`` (by default
    ``benchmarks/results/<result_name>``); the caller adds its own and parses."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(RESULTS, result_name))
    return ap


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


WIDTH = 4096


def stack_layers(gb: float) -> int:
    """How many WIDTH x WIDTH float32 layers make ``gb`` GiB of parameters."""
    return max(1, round(gb * 2**30 / (WIDTH * WIDTH * 4)))


def trained_stack(layers: int):
    """In a launched function: a stack of bias-free linear layers, one FSDP unit each, and
    AdamW after one step; with what this rank holds (its shards and their state), in bytes."""
    import torch
    import torch_xla
    from xla_fsdp import FSDP
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                  for _ in range(layers)])
    model = FSDP(torch.nn.Sequential(*[FSDP(m) for m in model]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, WIDTH, device=torch_xla.device())).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch_xla.sync()
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    own += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v))
    return model, opt, own


def measured_turns(rank: int, operations: dict, repeats: int, run, after=None) -> dict:
    """In a launched function: ``run(operation, turn)`` for every operation, once unrecorded
    (first-call costs: imports, threads, graphs), then ``repeats`` times in a rotating order,
    each between rendezvous; on rank 0 ``{name: [(bytes added, seconds), ...]}`` and
    ``after()`` after each call (cleaning up)."""
    import time
    import torch_xla.core.xla_model as xm
    items = list(operations.items())

    def done():
        xm.rendezvous("done")
        if rank == 0 and after is not None:
            after()
        xm.rendezvous("cleaned")
    for name, operation in items:
        run(operation, "warmup")
        done()
    results: dict = {}
    for i in range(repeats):
        for name, operation in items[i % len(items):] + items[:i % len(items)]:
            xm.rendezvous("before")
            before = reset_peak() if rank == 0 else 0
            xm.rendezvous("reset")
            start = time.monotonic()
            run(operation, i)
            xm.rendezvous("measured")
            if rank == 0:
                results.setdefault(name, []).append((peak_added(before),
                                                     time.monotonic() - start))
            done()
    return results


def launch_with_directory(fn, args: tuple, world: int):
    """``launch(fn, (*args, directory))`` with a temporary directory removed afterwards, large
    allocations their own mappings (so that freed memory is returned, not reused unseen)."""
    import shutil
    import tempfile
    from xla_fsdp import launch
    directory = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # the device process inherits it
    try:
        return launch(fn, tuple(args) + (directory,), num_devices=world)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def empty_directory(directory: str) -> None:
    """Removes everything in ``directory`` (what the last save wrote)."""
    import shutil
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def torch_xla_recipe(directory: str):
    """torch_xla's checkpoint recipe as a saver ``(rank, model, opt, i)``: ``xm.save`` of the
    model's state dict, its shard metadata and the optimizer's state dict on every rank."""
    def save(rank, model, opt, i):
        import torch_xla.core.xla_model as xm
        xm.save({"model": model.state_dict(), "shard_metadata": model.get_shard_metadata(),
                 "optimizer": opt.state_dict()},
                os.path.join(directory, f"recipe{i}_rank-{rank}"), master_only=False)
    return save
