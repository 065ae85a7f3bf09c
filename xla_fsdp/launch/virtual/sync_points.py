"""Routes every torch_xla call that compiles or waits through the turn ring.

Installed only in the process that hosts virtual CPU devices; nothing here runs on a TPU or
Trainium host. Calls made outside a device thread go straight to torch_xla.

What is routed:
* ``torch_xla.sync()`` / ``xm.mark_step()`` (the step marker),
* ``_xla_sync_live_tensors`` (FSDP's sync before an optimizer step's host reads),
* ``_xla_sync_multi`` (used by ``xm.save`` and friends) when the tensors' pending graph holds
  a collective,
* implicit syncs in user code: ``.item()``, ``print(t)``, ``bool(t)``, ``.cpu()``,
  ``nonzero``, ``t[mask] = 0``, ... of a tensor whose pending graph holds a collective,
  and the tensor a write through a boolean mask made, at once and on its own rank (see
  [Note: a masked write's rank-specific shape]),
* ``xm.rendezvous`` / ``xm.xla_rendezvous``: exchanged through the ring (the XLA version
  builds rank-specific graphs),
* ``xm.wait_device_ops()``: waits for this rank's device only (waiting on all devices from
  one thread while holding the GIL deadlocks the others),
* ``xm.all_gather(t, pin_layout=True)`` of one tensor: XLA's pinned all-gather instead of
  torch_xla's rank-specific all-reduce (see [Note: pinned all-gather]),
* ``xm.all_reduce`` of bf16 with a pinned layout: in float32 (see [Note: pinned bf16
  all-reduce]),
* ``time.sleep`` in a device thread: the other ranks run while it sleeps.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from ..._sharding.tensor_tree import collect_tensors
from ..._xla.host_reads import has_pending_collective, masked_write_result, runs_graph
from .turn_ring import TurnRing

_COLLECTIVE_BINDINGS = (
    "_xla_all_reduce", "_xla_all_reduce_inplace", "_xla_all_gather", "_xla_all_gather_out",
    "_xla_all_gather_coalesced", "_xla_all_gather_coalesced_out", "_xla_reduce_scatter",
    "_xla_reduce_scatter_out", "_xla_reduce_scatter_coalesced",
    "_xla_reduce_scatter_coalesced_out", "_xla_all_to_all", "_xla_collective_permute",
    "_xla_send", "_xla_recv")
# xm's own wrappers too: with default arguments some of them lower through
# torch.ops._c10d_functional and never touch the bindings above.
_COLLECTIVE_XM_FUNCTIONS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                            "collective_permute", "collective_broadcast", "send", "recv")
class DivergentGraphs(RuntimeError):
    """Ranks traced different graphs that contain collectives."""


class _RankContext(threading.local):
    rank: Optional[int] = None
    collectives_traced: bool = False
    compiling: int = 0  # inside the openxla bridge's compilation of a graph


class SyncPoints:
    """The patched entry points of one virtual-device process."""

    def __init__(self, ring: TurnRing, devices: List[str]) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm
        self._ring = ring
        self._devices = devices
        self._xlac = torch_xla._XLAC
        self._xm = xm
        self._local = _RankContext()
        self._board: Dict[int, bytes] = {}
        self._any_collective_this_round = False
        self._first_rank = 0
        self._ran_graph_this_round: Dict[int, bool] = {}  # rank -> dispatched a computation
        self._orig: Dict[str, Callable] = {}
        self._collective_programs: set = set()  # hashes of compiled regions with collectives

    # -- install ---------------------------------------------------------------------------
    def install(self) -> None:
        xlac, xm = self._xlac, self._xm
        for owner, name, patched in ((xlac, "_xla_step_marker", self._step_marker),
                                     (xlac, "_xla_sync_multi", self._sync_multi),
                                     (xlac, "_xla_sync_live_tensors", self._sync_live),
                                     (xlac, "_xla_wait_device_ops", self._wait_device_ops),
                                     (xm, "xla_rendezvous", self._rendezvous)):
            self._patch(owner, name, patched)
        for module, names in ((xlac, _COLLECTIVE_BINDINGS), (xm, _COLLECTIVE_XM_FUNCTIONS)):
            for name in names:
                if hasattr(module, name):
                    setattr(module, name, self._noting_collective(getattr(module, name)))
        self._patch(xm, "all_gather", self._all_gather)  # the original notes collectives
        self._patch(xm, "all_reduce", self._all_reduce)
        self._patch(time, "sleep", self._sleep)
        self._install_bridge()

    def _patch(self, owner: Any, name: str, patched: Callable) -> None:
        """``owner.name`` becomes ``patched``; the original is ``self._orig[name]``."""
        self._orig[name] = getattr(owner, name)
        setattr(owner, name, patched)

    def _install_bridge(self) -> None:
        # [Note: the compiling rank syncs alone] Dynamo's cache is shared by the device
        # threads, so only the first rank to reach a region compiles it, and torch_xla's
        # openxla bridge syncs this rank's device while it compiles (to read the region's
        # inputs as device data). The other ranks hit the cache and never make that sync,
        # so it cannot be a collective point: it runs at once, outside the ring. That is
        # only sound with no collective pending on the device, which FSDP guarantees by
        # running its gathers and reductions before a compiled region; a pending collective
        # in the region's inputs is refused by name instead of hanging.
        try:
            from torch_xla._dynamo import dynamo_bridge
        except ImportError:
            return
        for name in ("extract_compiled_graph", "extract_graph_helper"):
            self._patch(dynamo_bridge, name, self._compiling(name, getattr(dynamo_bridge, name)))
        # [Note: compiled regions that hold collectives] A region whose collectives were
        # traced with its compute (FSDP's compiled path) is one program that meets its peers'
        # copies: every rank must dispatch it at the same collective point, like a sync.
        self._patch(self._xlac, "_xla_warm_up_cache", self._warm_up_cache)
        self._patch(self._xlac, "_run_cached_graph", self._run_cached_graph)
        # Work pending before a compiled module or function is called (eager FSDP units
        # around it, the user's own collectives) runs on every rank as it enters, so that a
        # compile there finds no collective pending.
        from torch._dynamo.eval_frame import OptimizeContext
        context_init = OptimizeContext.__init__
        points = self

        def init_with_entry_sync(context: Any, *args: Any, **kwargs: Any) -> None:
            context_init(context, *args, **kwargs)
            context.enter_exit_hooks.append(points._entering_compiled_code)

        self._patch(OptimizeContext, "__init__", init_with_entry_sync)

    def _entering_compiled_code(self) -> Callable[[], None]:
        if self._rank is None or self._local.compiling:
            return lambda: None
        self._collective("entering torch.compile'd code", self._sync_own_device)
        # The rank's MaterializeGuard leaves the torch-function mode stack while compiled
        # code runs: Dynamo would trace the mode into the shared regions, specialised on the
        # rank that compiled them.
        from torch.overrides import _get_current_function_mode, _pop_mode_temporarily
        if not isinstance(_get_current_function_mode(), MaterializeGuard):
            return lambda: None
        popped = _pop_mode_temporarily()
        popped.__enter__()
        return lambda: popped.__exit__(None, None, None)

    def _compiling(self, name: str, compile_fn: Callable) -> Callable:
        def compile_alone(model: Any, args: Any, *rest: Any) -> Any:
            if self._rank is None:
                return compile_fn(model, args, *rest)
            inputs = _xla_tensors(list(args) if name == "extract_compiled_graph"
                                  else list(getattr(model, "xla_args", [])))
            if has_pending_collective(inputs):
                raise DivergentGraphs(
                    f"rank {self._rank}: a torch.compile region (openxla) is being "
                    f"compiled with inputs that depend on a collective not yet run; on "
                    f"virtual devices only the first rank compiles a region, so that "
                    f"collective would never meet its peers. Run the collective (e.g. "
                    f"torch_xla.sync()) before calling the compiled code.")
            self._local.compiling += 1
            try:
                compiled = compile_fn(model, args, *rest)
            finally:
                self._local.compiling -= 1
            if name != "extract_compiled_graph":
                return compiled
            return self._peers_sync_where_compiled(compiled, self._rank)
        return compile_alone

    def _warm_up_cache(self, tensors: List[torch.Tensor], devices: List[str]) -> Any:
        if self._local.compiling and has_pending_collective(_xla_tensors(tensors)):
            self._collective_programs.add(self._xlac._get_graph_hash(tensors))
        return self._orig["_xla_warm_up_cache"](tensors, devices)

    def _run_cached_graph(self, graph_hash: Any, inputs: List[Any]) -> Any:
        run = self._orig["_run_cached_graph"]
        if self._rank is None or graph_hash not in self._collective_programs:
            return run(graph_hash, inputs)
        return self._collective("a compiled region holding collectives",
                                lambda: run(graph_hash, inputs))

    def _peers_sync_where_compiled(self, compiled: Callable, compiler: int) -> Callable:
        # The compiling rank synced its device while compiling; the others' first call of
        # the region is the same point of their programs, and they sync there too, so that
        # every rank has the same work pending afterwards and traces the same graphs at its
        # next collective point. Nothing collective is pending then (see [Note: the
        # compiling rank syncs alone]), so this sync, like the compiler's, runs alone.
        synced = {compiler}

        def region(*args: Any) -> Any:
            rank = self._rank
            if rank is not None and rank not in synced:
                synced.add(rank)
                self._sync_own_device()
            return compiled(*args)
        return region

    def _sync_own_device(self) -> None:
        """What ``torch_xla.sync()`` does for the calling rank's device, past the ring."""
        device = self._devices[self._rank]
        self._orig["_xla_step_marker"](device, [], wait=False)
        self._xlac._set_all_reduce_token(device, None)

    def bind_rank(self, rank: int) -> "MaterializeGuard":
        """Marks the calling thread as ``rank``'s device thread."""
        self._local.rank = rank
        return MaterializeGuard(self)

    @property
    def _rank(self) -> Optional[int]:
        rank = self._local.rank
        if rank is None and torch._C._current_graph_task_id() != -1:
            rank = self._engine_thread_rank()
        return rank

    def _engine_thread_rank(self) -> Optional[int]:
        # [Note: backward runs on the autograd engine's device threads] The engine runs an
        # XLA backward on its own thread for each device, with that device current, while
        # the rank's thread waits in .backward() holding the turn. Eager backward only
        # traces, but a torch.compile region's backward executes (and syncs) there, so such
        # a thread acts as the rank of its device.
        device = self._xlac._xla_get_default_device()
        return self._devices.index(device) if device in self._devices else None

    def _noting_collective(self, binding: Callable) -> Callable:
        def traced(*args, **kwargs):
            if self._rank is not None:
                self._local.collectives_traced = True
            return binding(*args, **kwargs)
        return traced

    # -- the collective point with the divergence check -------------------------------------
    def _collective(self, kind: str, dispatch: Callable[[], Any]) -> Any:
        rank = self._rank

        def audited_dispatch():
            first = self._ring.first_to_dispatch
            if first:
                self._any_collective_this_round = False
                self._first_rank = rank
                self._ran_graph_this_round = {}
            if self._local.collectives_traced:
                self._any_collective_this_round = True
            before = self._xlac._xla_get_num_cached_compilation_graph()
            graphs_before = self._graphs_dispatched()
            result = dispatch()
            compiled = self._xlac._xla_get_num_cached_compilation_graph() > before
            self._ran_graph_this_round[rank] = self._graphs_dispatched() > graphs_before
            self._local.collectives_traced = False
            if (self._any_collective_this_round
                    and len(set(self._ran_graph_this_round.values())) > 1):
                raise DivergentGraphs(self._unpaired_sync(rank, kind))
            if not first and compiled and self._any_collective_this_round:
                raise DivergentGraphs(
                    f"rank {rank} traced a different graph from rank {self._first_rank} at "
                    f"{kind}, and the "
                    f"ranks' graphs contain collectives, which would never meet. Usual "
                    f"causes: a value that depends on the rank baked into the graph (e.g. "
                    f"`t * xr.global_ordinal()`; pass rank-dependent data in as a tensor "
                    f"instead), xm.all_gather(..., pin_layout=True) (it builds a "
                    f"rank-specific graph; use pin_layout=False), or a Python branch or a "
                    f"data-dependent op that differs between ranks (an expert routing that "
                    f"reads the batch, as Hugging Face's mixture-of-experts models do: ranks "
                    f"whose tokens chose other experts run other graphs, which on hardware "
                    f"pair wrongly; see docs/wrapper.md).")
            return result

        return self._ring.collective(rank, kind, _user_site(), audited_dispatch)

    def _graphs_dispatched(self) -> int:
        # Only the turn holder dispatches, so the process-wide counters' change over a
        # dispatch is its own. An empty sync compiles and runs nothing.
        counter = self._xlac._xla_counter_value
        return (counter("CachedCompile") or 0) + (counter("UncachedCompile") or 0)

    def _unpaired_sync(self, rank: int, kind: str) -> str:
        # [Note: a sync with nothing pending] Ranks that sync a different number of times
        # can still meet at every point by kind (all of them "torch_xla.sync()"), and then
        # a graph holding collectives is paired with a peer's sync that had nothing pending.
        # Nothing is compiled there, so the check for differing graphs does not see it; the
        # collectives would wait for the peer until XLA aborts. The ranks' sites say which
        # calls were paired (a loader that syncs at its next batch unless a StepTrace did,
        # a context manager that syncs on exit, an extra sync on some ranks).
        lines = []
        for r, ran in sorted(self._ran_graph_this_round.items()):
            arrival = self._ring.arrival(r)
            site = f" at {arrival.site}" if arrival is not None and arrival.site else ""
            what = "ran a graph" if ran else "had nothing pending"
            lines.append(f"  rank {r}: {what}{site}")
        return (f"ranks met at {kind} from different points of their programs: a rank ran a "
                f"graph holding collectives while another had nothing to run, so those "
                f"collectives would never meet (on real hardware this hangs):\n"
                + "\n".join(lines) + f"\n(found by rank {rank}). Every rank must sync the "
                f"same number of times and at the same points.")

    # -- patched entry points --------------------------------------------------------------
    def _sync(self, kind: str, sync: Callable[[bool], Any], wait: bool) -> Any:
        """``sync(wait)``; in a device thread, ``sync(False)`` at a collective point and then,
        if ``wait``, a wait for this rank's device alone."""
        # see [Note: the compiling rank syncs alone]
        if self._rank is None or self._local.compiling:
            return sync(wait)
        self._collective(kind, lambda: sync(False))
        if wait:
            self._wait_own_device()

    def _step_marker(self, device: str, devices: List[str], wait: bool = False,
                     reset_scope: bool = True) -> None:
        orig = self._orig["_xla_step_marker"]
        return self._sync("torch_xla.sync()", lambda w: orig(
            device, devices, wait=w, reset_scope=reset_scope), wait)

    def _sync_live(self, device: str, devices: List[str], wait: bool = True) -> None:
        orig = self._orig["_xla_sync_live_tensors"]
        return self._sync("a sync of the live tensors", lambda w: orig(device, devices, w), wait)

    def _sync_multi(self, tensors: List[torch.Tensor], devices: List[str], wait: bool = True,
                    sync_xla_data: bool = True) -> None:
        orig = self._orig["_xla_sync_multi"]

        def sync(w: bool) -> Any:
            return orig(tensors, devices, wait=w, sync_xla_data=sync_xla_data)
        if (self._rank is None or self._local.compiling
                or not has_pending_collective(tensors)):
            return sync(wait)
        self._local.collectives_traced = True  # as in materialize
        return self._sync("a sync of tensors that depend on a collective", sync, wait)

    def _wait_device_ops(self, devices: Iterable[str] = ()) -> None:
        if self._rank is None:
            return self._orig["_xla_wait_device_ops"](devices=list(devices))
        # Every peer's work was dispatched at a completed collective point, so this rank
        # can wait for its own device without starving anybody.
        self._wait_own_device()

    def _wait_own_device(self) -> None:
        own = self._xlac._xla_real_devices([self._devices[self._rank]])
        self._orig["_xla_wait_device_ops"](devices=own)

    def _rendezvous(self, payload: bytes = b"", ordinals: Optional[List[int]] = None,
                    tag: Optional[str] = None) -> List[bytes]:
        if self._rank is None:
            return self._orig["xla_rendezvous"](payload, ordinals, tag=tag)
        world = self._ring.world_size
        if ordinals and sorted(ordinals) != list(range(world)):
            raise ValueError("Only global rendezvous is supported")
        if not isinstance(payload, bytes):
            raise TypeError(f"`payload` must be bytes, not {type(payload)}")
        import torch_xla
        torch_xla.sync()  # as torch_xla's rendezvous does: pending work goes first
        rank = self._rank

        def post():
            self._board[rank] = payload

        self._collective("xm.rendezvous()", post)
        return [self._board[r] for r in range(world)]

    def _all_gather(self, value: Any, dim: int = 0, groups: Optional[List[List[int]]] = None,
                    output: Optional[torch.Tensor] = None, pin_layout: bool = True,
                    *args: Any, **kwargs: Any) -> Any:
        # [Note: pinned all-gather] For one tensor with pin_layout=True and no output,
        # torch_xla 2.9 gathers by all-reducing a zero buffer holding this rank's value at
        # its rank's offset, which bakes the rank into the graph: every rank compiles its
        # own module and the collectives never meet here. With an output buffer the same
        # call is XLA's own all-gather, layout still pinned, with the same values.
        if (self._rank is not None and pin_layout and output is None
                and isinstance(value, torch.Tensor)):
            dim = dim if dim >= 0 else value.dim() + dim
            count = len(groups[0]) if groups else self._ring.world_size
            shape = list(value.shape)
            shape[dim] *= count
            output = value.new_empty(shape)
        return self._orig["all_gather"](value, dim, groups, output, pin_layout, *args, **kwargs)

    def _all_reduce(self, reduce_type: str, inputs: Any, scale: float = 1.0,
                    groups: Optional[List[List[int]]] = None, pin_layout: bool = True) -> Any:
        # [Note: pinned bf16 all-reduce] XLA:CPU has no layout-pinned all-reduce of bf16 (a
        # TPU has): alone it raises, inside a larger graph (FSDP's hybrid sharding averaging
        # bf16 gradients across replicas) it corrupts memory. Here such a reduction runs in
        # float32 and is rounded back, which is what a bf16 sum of these values gives.
        orig = self._orig["all_reduce"]
        tensors = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        if self._rank is None or not pin_layout or \
                not any(t.dtype == torch.bfloat16 for t in tensors):
            return orig(reduce_type, inputs, scale, groups, pin_layout)
        widened = orig(reduce_type, [t.float() if t.dtype == torch.bfloat16 else t
                                     for t in tensors], scale, groups, pin_layout)
        narrowed = [w.to(t.dtype) for w, t in zip(widened, tensors, strict=True)]
        if isinstance(inputs, torch.Tensor):
            return narrowed[0]
        for t, value in zip(tensors, narrowed, strict=True):   # in place, as torch_xla's
            if t.dtype == torch.bfloat16:
                t.copy_(value)
        return inputs

    def _sleep(self, seconds: float) -> None:
        # A device thread that sleeps is waiting for something its peers do (e.g. files
        # they write): let them run meanwhile instead of holding the turn.
        if self._rank is None:
            return self._orig["sleep"](seconds)
        self._ring.step_aside(self._rank, lambda: self._orig["sleep"](seconds))

    # -- implicit syncs --------------------------------------------------------------------
    def materialize(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Syncs, as a collective point, XLA tensors that ``func`` is about to read back."""
        if self._rank is None or not runs_graph(func, args, kwargs):
            return
        name = getattr(func, "__name__", "")
        written = masked_write_result(func, args, None)
        # a write into a view also writes its base, which settle_masked_write syncs alone
        base = getattr(written, "_base", None)
        pending = _xla_tensors((args, kwargs, base))
        if not has_pending_collective(pending):
            return
        orig = self._orig["_xla_sync_multi"]
        # The collective may have been traced before an earlier point that synced other
        # tensors; it is still in this graph, so the check for differing graphs applies.
        self._local.collectives_traced = True
        # sync_xla_data=False: with True, torch_xla 2.9 donates the input buffer of a
        # tensor updated in place by a collective (xm.all_reduce on a list) and then reads
        # it ("buffer ... is deleted"). The values are materialized either way.
        self._collective(f"reading a tensor value ({name})", lambda: orig(
            pending, [], wait=False, sync_xla_data=False))

    def settle_masked_write(self, func: Any, args: tuple, result: Any) -> None:
        """Syncs, on this rank alone, the tensor that a write through a boolean mask made.

        [Note: a masked write's rank-specific shape] ``t[mask] = v`` lowers to an
        ``index_put`` whose indices are the mask's nonzero positions, so the shape of that
        index tensor, a count, is baked into ``t``'s pending graph. With sharded state the
        count differs per rank (torch's Rprop masks the signs of each rank's gradient shard),
        and any later graph that holds a collective and reads ``t`` (the next write's mask,
        read with a pending reduce-scatter; the next forward's all-gather of the updated
        shard) is then a different module on every rank, whose collectives never meet.
        Syncing ``t`` right after the write leaves the count in a graph of its own. That
        graph holds no collective, since ``materialize`` synced every pending collective
        the write read, so each rank runs it alone, outside the ring. On real hardware the
        ranks' programs may differ in such shapes, so this exists only here."""
        if self._rank is None:
            return
        written = masked_write_result(func, args, result)
        if written is None:
            return
        tensors = _xla_tensors([written, getattr(written, "_base", None)])
        if tensors:
            self._orig["_xla_sync_multi"](tensors, [], wait=False, sync_xla_data=False)


class MaterializeGuard(TorchFunctionMode):
    """Thread-local mode that turns implicit syncs into collective points."""

    def __init__(self, points: SyncPoints) -> None:
        super().__init__()
        self._points = points

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._points.materialize(func, args, kwargs)
        result = func(*args, **kwargs)
        self._points.settle_masked_write(func, args, result)
        return result


def _xla_tensors(obj: Any) -> List[torch.Tensor]:
    # FakeTensors (AOTAutograd tracing a scanned layer) have a device and no value
    return [t for t in collect_tensors(obj)
            if t.device.type == "xla" and not isinstance(t, FakeTensor)]


def _user_site() -> str:
    """The innermost stack frame outside torch, torch_xla and this package."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not any(part in filename for part in ("/torch/", "/torch_xla/",
                                                  "/xla_fsdp/launch/virtual/", "/contextlib.py")):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"
