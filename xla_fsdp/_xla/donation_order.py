"""Keeps torch_xla from copying every parameter and optimizer state tensor each step.

torch_xla 2.9 marks the buffers of tensors that a step updates as donors but leaves the
pairing of donors with outputs to XLA, which matches them by byte size alone: the k-th
donated parameter of a size (in HLO parameter order) gets the k-th output of that size (in
output order). Parameter order follows the traced graph (first read first), output order
follows tensor creation. In a training step the two disagree: gradients, created in
backward, come before every updated tensor, and AdamW writes its moments after the
parameter is first read. Each wrongly paired buffer costs a full copy in and out of the
step, i.e. one extra copy of the shards and the optimizer state held for the whole step.

Two no-op operations make both orders the same list, ``donors()``:
* ``pin_parameter_order`` at the start of the root unit's forward: one optimization barrier
  over all donors numbers them in that order before anything else reads them;
* ``reissue_in_order`` right after the optimizer step: ``mul_(1)`` (folded away by XLA)
  gives every donor, and then every gradient, a newer tensor in that order.

[Note: shards no optimizer holds are donors too]
A unit's barriers rewrite its shards, so every shard is donated and replaced by the step,
those no optimizer holds as well: frozen layers (a fine-tuning that freezes the first
layers), or parameters left out of the optimizer. Those came out at backward time, before
every donor, and where one had a donor's byte size the pairing shifted along every later
tensor of that size: freezing the first 3 of 6 alike layers copied 48 shards and moments a
step. So the root lists its units' shards; the ones no optimizer on its device holds are
pinned after the optimizers' donors and reissued after each optimizer's donors, before the
gradients. An optimizer reissues those of the roots that ran a forward since its last step
only: a model no longer run (an earlier one, alive until the garbage collector frees it)
would otherwise put its shards into every step until it is freed, and the step would compile
again then.

[Note: an optimizer left behind is not pinned]
An optimizer still alive but no longer stepping (a fine-tuning's first phase, kept in a
variable when the second phase builds another) had its state pinned into every later step:
rewritten as an output of each step and, where its sizes met the live donors', copied in and
out (9 copies a step in a two-phase toy). A root therefore pins an optimizer only while the
forwards on its device since that optimizer's last step number at most twice the longest
such gap it has shown, and at least ``_PATIENCE``: gradient accumulation over k micro-batches
(a gap of k, learnt at its first step, counted from the last step any optimizer took on the
device) and a step GradScaler skips keep it pinned; one left behind drops out after that
many forwards, the step compiles once more, and the copies end. If it steps again it is
pinned again from the next root forward.
Only forwards that take gradients count: an evaluation loop between training steps would
otherwise leave the training optimizer behind, and the first training step after it would
compile once more. The count is kept per device and changes only in that device's own
calls, so every rank decides alike and traces the same step graph.

[Note: an update that runs as a program of its own]
A step whose optimizer reads values on the host is cut in two by a sync before the reads
(``_unit.step_reads``): forward and backward, then the update. The root's pin numbers the
first program's parameters; the update's program reads the donors, and the gradients, now
device data, in the order the optimizer first reads them, and writes them back in the order
``reissue_in_order`` gives, so XLA paired them by size across the two orders and copied (14
buffers a step for GradScaler over AdamW on a three-block toy, 12 of torch's Adafactor's 24).
``pin_update_order``, right after the last sync before the update, numbers them as the hook
reissues them: every stepping optimizer's donors on the device, the shards no optimizer
holds, the gradients. After GradScaler's sync (an optimizer that does not read) the barrier
that numbers them sits on the tensors themselves, as the root's pin does: every path of the
update's graph to a donor passes through it, so it numbers the parameters whatever is lowered
first. The update then copies only GradScaler's two 4-byte scalars (the growth tracker and
the scale).
An optimizer that reads (torch's Adafactor reads the norm of each parameter and update)
would then run every read's program with the barrier's thousands of buffers as inputs (the
toy's Adafactor step went from 61 to 221 ms a step on virtual devices). After its sync the
barrier sits on stand-ins, ``t * 1`` of each, which XLA folds back into the tensors, and the
reads never see it. What puts it into the update's program is a scalar of no elements taken
from its first output (a sum over an empty slice: the barrier is lowered, then XLA folds the
scalar to a constant, so no donor is read beside its update), held until the next pin on the
device. Made before the update writes anything, the scalar is lowered ahead of every tensor
the update writes, and its barrier numbers the program's parameters: torch's Adafactor's
update copies none of the toy's 24 buffers (12 without the pin). That rests on the order
torch_xla lowers a sync's tensors in, oldest first, which an older tensor given pending work
after the pin defeats: a forward between the step and its sync (a step taken at the top of
the next iteration, an evaluation on the batch after the step) rewrites its input in place,
and the update is then numbered in its read order and copies as before.

[Note: every optimizer's gradients after every donor]
The gradients are outputs of the step too, of the same byte sizes as their parameters, so
they must come after every donor in output order, not only after their own optimizer's.
An optimizer's hook therefore reissues the gradients of every optimizer that steps shards
on its device. Reissuing only its own left the first optimizer's gradients between its
donors and the next optimizer's: with two roots (a GAN's generator and discriminator), or
one model's parameters split between two optimizers, XLA paired the later optimizer's
donors with the earlier one's gradients and copied 12 buffers a step in a two-root toy.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._sharding.collectives import optimization_barrier
from .private_api import multiplied, multiply_in_place


class _Donors:
    """An optimizer's donors, and its XLA parameters (whose gradients are reissued too), as
    of the last time they were listed; reused while the optimizer holds the same tensors.

    Listing them reads every tensor's device, a torch call per tensor; the step's host time
    should not grow with that (see [Note: per-step host cost]). What the optimizer holds is
    compared by identity: the ids of its parameters and state values (no tensor is hashed or
    compared, which would be torch calls too). The lists are kept as weak references, so a
    state replaced by ``load_state_dict`` is freed as before, and an id reused by a newer
    tensor cannot pass for the old one."""

    def __init__(self) -> None:
        self.holdings: Optional[tuple] = None
        self.tensors: List["weakref.ref[torch.Tensor]"] = []
        self.devices: List[torch.device] = []
        self.params: List["weakref.ref[torch.Tensor]"] = []
        # the devices of its donors: what another rank's hook or root asks before listing
        # them (on virtual devices every rank's optimizers are in ``_optimizers``)
        self.on: frozenset = frozenset()
        self.ids: frozenset = frozenset()   # of its donors, for the shards it does not hold
        self.reissued_at = _pins  # roots' forwards counted until its last step
        # per device: its forwards counted at this optimizer's last step, and the longest
        # run of forwards between two of its steps (see [Note: an optimizer left behind is
        # not pinned])
        self.stepped_at: Dict[torch.device, int] = {}
        self.longest_gap: Dict[torch.device, int] = {}

    def stepped(self) -> None:
        """Counts a step on each of its devices. Its first step's gap is counted from the
        last step any optimizer took there (from the start if none did): the micro-batches
        of a first accumulation cycle, or a second phase's first cycle."""
        for device in self.on:
            now = _forwards.get(device, 0)
            since = self.stepped_at.get(device, _last_step.get(device, 0))
            self.longest_gap[device] = max(self.longest_gap.get(device, 0), now - since)
            self.stepped_at[device] = _last_step[device] = now

    def still_stepping(self, device: torch.device) -> bool:
        """Whether it has stepped recently enough on ``device`` to be pinned there."""
        now = _forwards.get(device, 0)
        since = now - self.stepped_at.get(device, now)
        return since <= max(_PATIENCE, 2 * self.longest_gap.get(device, 0))

    def current(self, optimizer: torch.optim.Optimizer) -> Tuple[List[torch.Tensor],
                                                                  List[torch.device],
                                                                  List[torch.Tensor]]:
        holdings = (tuple(id(p) for param_group in optimizer.param_groups
                          for p in param_group["params"]),
                    tuple((id(p), tuple(state), tuple(map(id, state.values())))
                          for p, state in optimizer.state.items()))
        if holdings == self.holdings:
            tensors = [ref() for ref in self.tensors]
            params = [ref() for ref in self.params]
            if all(t is not None for t in tensors) and all(p is not None for p in params):
                return tensors, self.devices, params
        tensors = donors(optimizer)
        params = [p for param_group in optimizer.param_groups for p in param_group["params"]
                  if p.device.type == "xla"]
        self.holdings = holdings
        self.tensors = [weakref.ref(t) for t in tensors]
        self.devices = [t.device for t in tensors]
        self.params = [weakref.ref(p) for p in params]
        self.on = frozenset(self.devices)
        self.ids = frozenset(map(id, tensors))
        return tensors, self.devices, params


# in the order they first stepped shards, the same on every rank (a WeakSet's order follows
# object addresses, which differ between ranks, and so would the ranks' step graphs)
_optimizers: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Donors]" = \
    weakref.WeakKeyDictionary()
# on virtual devices the ranks are threads of one process: one rank's first step adds its
# optimizer while another's hook or root lists them
_listing = threading.Lock()


def _stepping() -> List[Tuple[torch.optim.Optimizer, _Donors]]:
    with _listing:
        return list(_optimizers.items())


# each root's shards that no optimizer holds, with what they were listed from: (the ids of
# its shards and of the optimizers' donor sets, its device, the shards, the count of roots'
# forwards at its last one)
_unheld: "weakref.WeakKeyDictionary[Any, Tuple[tuple, torch.device, List[torch.Tensor], int]]" \
    = weakref.WeakKeyDictionary()
_pins = 0   # roots' forwards so far, on any device
_forwards: Dict[torch.device, int] = {}   # roots' forwards taking gradients, per device
_last_step: Dict[torch.device, int] = {}  # _forwards at any optimizer's last step there
_PATIENCE = 8   # forwards an optimizer may go without a step and stay pinned
# per device, the scalar that carries a reading optimizer's update pin into the step's sync
# (see [Note: an update that runs as a program of its own])
_update_pins: Dict[torch.device, torch.Tensor] = {}


def _unheld_shards(root: Any, device: torch.device, shards: Sequence[torch.Tensor],
                   holders: List[frozenset]) -> List[torch.Tensor]:
    """``root``'s ``shards`` on ``device`` that none of the ``holders`` (donor id sets)
    holds, listed again only when the shards or the optimizers' holdings changed (see
    [Note: shards no optimizer holds are donors too])."""
    global _pins
    key = (tuple(map(id, shards)), tuple(map(id, holders)))
    with _listing:
        known = _unheld.get(root)
    unheld = known[2] if known is not None and known[0] == key else [
        s for s in shards if s.device == device and not any(id(s) in ids for ids in holders)]
    with _listing:
        _pins += 1
        _unheld[root] = (key, device, unheld, _pins)
    return unheld


def donors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every tensor an optimizer step updates on an XLA device, parameter by parameter."""
    out = []
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            if p.device.type != "xla":
                continue
            state = optimizer.state.get(p, {})
            out.append(p)
            out.extend(state[k] for k in sorted(state, key=str)
                       if torch.is_tensor(state[k]) and state[k].device == p.device)
    return out


@torch.no_grad()
def reissue_in_order(is_shard: Callable[[torch.Tensor], bool], optimizer: torch.optim.Optimizer,
                     args: Any = (), kwargs: Any = None) -> None:
    """Optimizer step post-hook, with ``is_shard`` bound; acts on optimizers that step FSDP
    shards."""
    cache = _optimizers.get(optimizer)
    if cache is None:
        if not any(is_shard(p)
                   for param_group in optimizer.param_groups for p in param_group["params"]):
            return
        with _listing:
            cache = _optimizers.setdefault(optimizer, _Donors())
    # one foreach call each: a mul_ per tensor costs the host ~50 us in torch's Python meta
    # checks, hundreds of times a step; the foreach op makes the same newer tensors, in order
    tensors, _, params = cache.current(optimizer)
    with _listing:  # see [Note: shards no optimizer holds are donors too]
        tensors = tensors + _unheld_since(cache)
        cache.reissued_at = _pins
        cache.stepped()
    if tensors:
        multiply_in_place(tensors, 1)
    grads = _gradients(cache, params)
    if grads:
        multiply_in_place(grads, 1)


def _unheld_since(cache: _Donors) -> List[torch.Tensor]:
    """Under ``_listing``: the shards no optimizer holds, on ``cache``'s devices, of the
    roots that ran a forward since its optimizer last stepped."""
    return [s for _, device, shards, at in _unheld.values()
            if at > cache.reissued_at and device in cache.on for s in shards]


def _gradients(cache: _Donors, params: List[torch.Tensor]) -> List[torch.Tensor]:
    """The gradients of every optimizer stepping shards on ``cache``'s devices (``params``:
    its own optimizer's), see [Note: every optimizer's gradients after every donor]."""
    return [p.grad for opt, other in _stepping() if other.on & cache.on
            for p in (params if other is cache else other.current(opt)[2])
            if p.grad is not None and p.device in cache.on]


def _pinned_donors(device: torch.device) -> Tuple[List[torch.Tensor], List[frozenset]]:
    """The donors on ``device`` of the optimizers still stepping there, in the order they
    first stepped, and their donor id sets (see [Note: an optimizer left behind is not
    pinned])."""
    tensors, holders = [], []
    for opt, cache in _stepping():
        if device in cache.on and cache.still_stepping(device):
            held, devices, _ = cache.current(opt)
            tensors += [t for t, d in zip(held, devices) if d == device]
            holders.append(cache.ids)
    return tensors, holders


@torch.no_grad()
def pin_update_order(optimizer: torch.optim.Optimizer, device: torch.device,
                     reads: bool) -> None:
    """Called right after the last sync that cuts ``optimizer``'s step on ``device``, before
    its update reads anything (see [Note: an update that runs as a program of its own]): the
    order ``reissue_in_order`` will give; ``reads``: the optimizer reads values on the host
    in its step. An optimizer that has not stepped yet has nothing to pair."""
    cache = _optimizers.get(optimizer)
    if cache is None:
        return
    tensors, _ = _pinned_donors(device)
    with _listing:
        tensors += _unheld_since(cache)
    # the traced graph numbers a node's inputs last to first
    ordered = list(reversed(tensors + _gradients(cache, cache.current(optimizer)[2])))
    _update_pins.pop(device, None)
    if not ordered or not reads:
        optimization_barrier(ordered)
        return
    stand_ins = multiplied(ordered, 1)
    optimization_barrier(stand_ins)
    _update_pins[device] = stand_ins[0].reshape(-1)[:0].sum()


@torch.no_grad()
def pin_parameter_order(device: torch.device, root: Any, shards: Sequence[torch.Tensor],
                        training: bool) -> None:
    """Called by a root unit before its forward reads anything, for its device, with the
    shards of its units; ``training``: the forward takes gradients."""
    if training:  # see [Note: an optimizer left behind is not pinned]
        with _listing:
            _forwards[device] = _forwards.get(device, 0) + 1
    tensors, holders = _pinned_donors(device)
    if holders:
        tensors += _unheld_shards(root, device, shards, holders)
    # the traced graph numbers a node's inputs last to first
    optimization_barrier(list(reversed(tensors)))
