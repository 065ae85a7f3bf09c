"""Starting a device process on this machine: forked from a server that has imported
torch_xla once, instead of a fresh interpreter that imports it again.

[Note: device processes fork from a warm server]
A device process (the virtual devices of one ``launch``, the planner's traced process) is
a new process each time, so that every launch gets a fresh XLA runtime with its own
device count. Spawning one costs about 6 s before the first line of user code, nearly all
of it importing torch and torch_xla; a test suite or a script that launches many times pays
that on every launch. So the process is forked from multiprocessing's fork server, which
imports torch_xla once (``_PRELOAD``) and never starts XLA's runtime: what a child needs
fresh (the PJRT client, its devices, the compile cache, the thread pools) is created on
first use, after the fork, from the child's own environment.

What the server cannot give a child is what torch_xla read from the environment while it
was imported. The child gets the parent's whole environment at launch, with the launch's
own variables, before anything runs, and XLA parses ``XLA_FLAGS`` at its first compile,
after the fork. But when a variable read at import or at process start (``_READ_AT_IMPORT``,
``_READ_AT_START``) differs from the server's, which has the environment of the first
launch, the process is spawned as before, so that the variable takes effect. Standard
output is the parent's at launch too, not the server's, and the child runs its atexit
handlers as a spawned one does (a forked one ends in ``os._exit``). Where fork is not
available the process is spawned, and the accelerator path (torch_xla's own runner) never
comes here.

[Note: the fork server ignores the job's SIGTERM]
``timeout``, a terminal's job control and schedulers that stop a process group send SIGTERM
to every process in it, and the fork server is one: it died of it, and the parent, which
learns a forked child's exit status through the server, reported the device process dead
(code 255) while that process was still saving its preemption checkpoint. So the server is
started with SIGTERM ignored (a disposition it keeps across its exec); it ends when its
parent does, as it always did. A forked child takes SIGTERM's default back before anything
runs, so it is preempted as a spawned one is, and it asks to be killed if the server goes
(``PR_SET_PDEATHSIG``): killed with it, a device process no longer trains on as an orphan
after its launch reported it dead. Two gaps remain. A SIGTERM that reaches a forked child
before it takes the default back (while it imports the script and unpickles its target) is
ignored: a blocked signal would wait instead, but a signal mask does not outlive the
server's exec. And a server started from another thread than the main one, where no
handler can be set, still dies of the group's SIGTERM; its children then keep the old
behaviour (not killed with it), so that they still save.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

from .environment import environment_for_child

_PRELOAD = ["torch", "torch_xla", "torch_xla.runtime", "torch_xla.core.xla_model"]
# What torch_xla's import reads (its __init__: debug mode, plugins, logging, the deprecated
# fp16 switches), and what the dynamic loader, Python and OpenMP read when a process starts.
# Other variables are read when first used, after the fork: ours, XLA_FLAGS (parsed at the
# first compile), the device count and thread pool of the launch; torch writes some of its
# own as it runs (TORCHINDUCTOR_CACHE_DIR), which must not stop the forking.
_READ_AT_IMPORT = {"PT_XLA_DEBUG", "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL",
                   "TF_CPP_VMODULE", "XLA_REGISTER_INSTALLED_PLUGINS",
                   "XLA_USE_EAGER_DEBUG_MODE", "XLA_USE_FP16", "XLA_DOWNCAST_FP16"}
_READ_AT_START = ("LD_", "PYTHON", "OMP_", "MKL_", "KMP_")
_PR_SET_PDEATHSIG = 1   # prctl's option (linux/prctl.h)
_LOCK = threading.Lock()
_server_environment: Optional[Dict[str, str]] = None


def start(target: Callable[..., None], args: Tuple[Any, ...],
          env: Mapping[str, str]) -> multiprocessing.process.BaseProcess:
    """Starts ``target(*args)`` in a new process that runs with this process's environment
    updated by ``env``, and returns it (see [Note: device processes fork from a warm
    server]). ``args`` may hold multiprocessing connections."""
    ctx = _warm_context(env)
    if ctx is None:
        with environment_for_child(env):  # a spawned child is born with it
            process = multiprocessing.get_context("spawn").Process(
                target=target, name="xla_fsdp-devices", args=args)
            process.start()
        return process
    process = ctx.Process(target=_run_in_environment, name="xla_fsdp-devices",
                          args=(dict(os.environ, **env), _ParentStdout(), target) + tuple(args))
    process.start()
    return process


def _fingerprint(environment: Mapping[str, str]) -> Dict[str, str]:
    return {k: v for k, v in environment.items()
            if k in _READ_AT_IMPORT or k.startswith(_READ_AT_START)}


def _warm_context(env: Mapping[str, str]):
    """The fork-server context when the server's import-time environment is this
    process's (starting the server with it the first time), else None."""
    global _server_environment
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    with _LOCK:
        now = _fingerprint(os.environ)
        if _server_environment is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
            with environment_for_child(env), _sigterm_ignored():
                # what torch_xla's import sees in the server, and see [Note: the fork server
                # ignores the job's SIGTERM]
                from multiprocessing import forkserver
                forkserver.ensure_running()
            _server_environment = now
            return ctx
        if now != _server_environment:
            return None
        return multiprocessing.get_context("forkserver")


@contextlib.contextmanager
def _sigterm_ignored() -> Iterator[None]:
    """SIGTERM ignored in this process while it lasts, where a handler can be set (the
    main thread); elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _die_with_the_server() -> None:
    """Linux: this process is killed when its parent, the fork server, ends."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _ParentStdout:
    """This process's standard output, passed to a forked child as a file descriptor: the
    server's own may be a file that the parent has since stopped reading (pytest's capture,
    a redirection), where the child's prints would be lost."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd
        sys.stdout.flush()
        return (_ReceivedFd, (DupFd(1),))


class _ReceivedFd:
    def __init__(self, handle) -> None:
        self.fd = handle.detach()


def _run_in_environment(environment: Dict[str, str], stdout: _ReceivedFd,
                        target: Callable[..., None], *args: Any) -> None:
    # see [Note: the fork server ignores the job's SIGTERM]
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:   # a server that ignores it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_the_server()
    os.environ.clear()
    os.environ.update(environment)
    os.dup2(stdout.fd, 1)
    os.close(stdout.fd)
    try:
        target(*args)
    finally:
        # a forked child ends in os._exit, which runs no atexit handler; a spawned one
        # runs them at exit (torch_xla's runtime teardown, the report of a save never
        # published), and so does this one
        atexit._run_exitfuncs()
