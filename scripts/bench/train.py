"""The training loop every competitor runs, with its timings (``train``), and one rank's run
of it under ``xla_fsdp.launch`` (``run_rank``)."""
from __future__ import annotations

import threading
import time
from typing import Optional

import torch

from .hlo import mark
from .model import Config, batch, build_model, wrap

EXECUTE_METRICS = ("ExecuteTime", "ExecuteReplicatedTime")  # per-rank graphs; SPMD


def metric(name: str) -> tuple:
    """(count, seconds) of a torch_xla timing metric, process-wide."""
    import torch_xla.debug.metrics as met
    data = met.metric_data(name)
    return (data[0], data[1] / 1e9) if data else (0, 0.0)


class EngineThread:
    """CPU time of the autograd engine's thread that runs this rank's backward.

    On XLA, backward does not run on the thread that calls ``loss.backward()``: PyTorch's
    engine hands it to a thread of its own per device (checked: a hook on the loss runs on
    another thread, one per virtual device). Tracing backward, and every backward hook of a
    wrapper, costs that thread's CPU, which ``time.thread_time()`` in the rank's thread does
    not see. A hook on each step's loss names the thread; its CPU clock is then read like
    ours."""

    def __init__(self) -> None:
        self.ident: Optional[int] = None

    def watch(self, loss) -> None:
        loss.register_hook(self._seen)

    def _seen(self, grad) -> None:
        self.ident = threading.get_ident()

    def cpu(self) -> float:
        """Seconds since the thread started (0 before any backward)."""
        if self.ident is None:
            return 0.0
        return time.clock_gettime(time.pthread_getcpuclockid(self.ident))


def run_rank(rank: int, impl: str, setting: str, cfg: Config,
             marks_dir: Optional[str], launched_at: float = 0.0) -> dict:
    """Trains ``cfg.steps`` steps on one rank; see ``train``."""
    import torch_xla
    device = torch_xla.device()

    def make_batch(step):
        return tuple(t.to(device) for t in batch(cfg, rank, step))

    def build():
        model = wrap(build_model(cfg), impl, setting)
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    return train(build, make_batch, cfg.steps, marks_dir if rank == 0 else None, launched_at)


def train(build, make_batch, steps: int, marks_dir: Optional[str],
          launched_at: float) -> dict:
    """Builds (model, optimizer) with ``build()`` and trains ``steps`` steps; returns per-step
    wall times, losses, compile counts and the phases of each step:

    - ``host``: CPU time of this rank from the step's start until ``torch_xla.sync()``
      returns: tracing forward, backward and the optimizer, hashing the graph, compiling it
      when new, launching it. It is the sum of ``host_thread``, this thread's CPU time, and
      ``host_backward``, the CPU time of the engine thread that traced backward (see
      ``EngineThread``). Other ranks' threads are not counted;
    - ``dispatch``: wall time of the same span. On virtual devices it also holds the other
      ranks' tracing (one GIL, and the launcher's sync waits for every rank);
    - ``wait``: wall time from there until the loss is on the host: the device executing;
    - ``execute``: torch_xla's execute-time metric for the step, per execution.

    ``startup_seconds``: from ``launched_at`` (``time.time()`` in the parent before it
    started the process) until the first step is done. With ``marks_dir``, notes which HLO
    dumps and which part of torch_xla's debug file belong to step 2, the first step with
    optimizer state: its graph is the one every later step reuses."""
    import torch_xla
    import torch_xla.debug.metrics as met

    def compiles() -> int:
        return int(met.counter_value("UncachedCompile") or 0)

    def executions() -> tuple:
        got = [metric(m) for m in EXECUTE_METRICS]
        return sum(c for c, _ in got), sum(t for _, t in got)

    t0 = time.perf_counter()
    model, optimizer = build()
    wrap_seconds = time.perf_counter() - t0
    compiles_at_start = compiles()
    out = {k: [] for k in ("times", "losses", "compile_counts", "host", "host_thread",
                           "host_backward", "dispatch", "wait", "execute")}
    engine = EngineThread()
    for step in range(steps):
        x, y = make_batch(step)
        if marks_dir and step == 1:
            mark(marks_dir, "before")
        before = executions()
        start, cpu, backward_cpu = time.perf_counter(), time.thread_time(), engine.cpu()
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        engine.watch(loss)
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        dispatched, cpu = time.perf_counter(), time.thread_time() - cpu
        backward_cpu = engine.cpu() - backward_cpu
        out["losses"].append(loss.item())
        end = time.perf_counter()
        count, seconds = (a - b for a, b in zip(executions(), before))
        if step == 0:
            out["startup_seconds"] = time.time() - launched_at
        for key, value in (("times", end - start), ("host", cpu + backward_cpu),
                           ("host_thread", cpu), ("host_backward", backward_cpu),
                           ("wait", end - dispatched),
                           ("dispatch", dispatched - start),
                           ("execute", seconds / count if count else 0.0),
                           ("compile_counts", compiles())):
            out[key].append(value)
        if step == 0:
            out["compile_seconds_step_1"] = metric("CompileTime")[1]
        if marks_dir and step == 1:
            mark(marks_dir, "after")
    return dict(out, wrap_seconds=wrap_seconds, compiles_at_start=compiles_at_start,
                compile_seconds=metric("CompileTime")[1])
