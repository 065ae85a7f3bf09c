"""The space users live in, as a matrix: how the model is wrapped (recipe), the wrapper's
options, the optimizer (plain or foreach), and the checkpoint format it is saved in and
resumed from, at the same world size or another. Each cell trains at N ranks against the
same model trained unsharded on one device, saves, continues, and a fresh wrapped model
loads the checkpoint and trains on; every run is held to the suite's parity bounds.

A cell's outcome is "matched", or "refused: <message>" when the wrapper or a checkpoint
function refused it at construction, at the first step or at the save or load. Every refusal
is listed in ``REFUSALS`` with the words its message must contain: an unlisted refusal, a
difference beyond the bounds, a hang or an abort fails the matrix.

[Note: covering the matrix]
The full product (5 recipes x 7 options x 10 optimizers x 2 x 4 formats x 2 world sizes)
is 5,600 cells, and a cell compiles its own step graphs: several seconds each here. The
suite runs a pairwise covering instead: every value of every axis meets every value of
every other axis in some cell. A bug that needs two axes to show, as each one issue 53 found
did (offload with torch_xla's recipe, Adafactor with dim-0 shards, per-rank state with a
consolidated checkpoint), shows in it. The two largest axes (options x optimizers) need 70
cells (63 in the suite's); the others are filled in greedily so that those cells, and a few
more if needed, cover every pair. ``python -m tests.support.matrix --product`` runs the full product, or any
part of it.

The suite's covering leaves out Rprop (``SUITE_AXES``): every write through a boolean mask
in its update has a shape that depends on the values, so XLA compiles a graph per write and
per step, and its cells take a minute each here instead of five seconds. Its parity with
FSDP is checked in ``tests/launch/test_behaviour.py``, its covering by the script.

[Note: a low-precision reference reduces as the ranks do]
With ``compute_dtype=torch.bfloat16`` each rank's gradient is bf16 and the ranks sum them in
bf16, where one device sums the whole batch once: data parallelism itself, with or without
FSDP, moves a gradient by a rounding. A gradient at rounding level of zero then changes
sign, and an adaptive optimizer moves that weight by a whole step the other way; Rprop also
halves that weight's step size from then on. Against the one-device run, Rprop at N=2 had 2
of a bias's 70 elements beyond 1e-3 by data parallelism alone (the one-device run cutting
each batch in two and summing the bf16 halves, no FSDP anywhere), and 4 in the grouped
recipe, against the bounds' 2. So a low-precision cell's reference cuts each batch as the
ranks do and sums the parts' bf16 gradients in rank order (``_backward_as_ranks``), and the
bounds stay as they are: the reference is the arithmetic FSDP must reproduce, not a
tolerance for it. The launches also keep XLA from computing bf16 results in float32 where a
program's shape allows it (``exact_low_precision``): otherwise the same forward rounds
differently in one recipe's programs than in another's (rank 0's loss before the first step
was 1.568170 grouped, 1.568138 auto-wrapped). With it, the grouped, auto-wrapped and
moved-first recipes gave the same parameters to the last bit of the printed figures (3 of
that bias's elements beyond 1e-3 of the one-device run, at most 0.012), and against this
reference the Rprop bf16 cells run (grouped and auto-wrapped, resumed at N=2 and at N=4)
are within the bounds.
"""
import contextlib
import functools
import itertools
import os
import sys
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .bounds import loss_problems, parameter_problems, precision
from .models import GLOBAL_BATCH, Block, batch, build_model, forward_in, loss_fn

# The model (a kind of ``models.Stack``: inp, three blocks in a ModuleList, head, the shape
# every recipe takes) and the seed of its initial weights and data: the suite's are "stack"
# and 0; ``--model`` and ``--seed`` run the same matrix on others. Read from the environment,
# which the launched device processes inherit.
KIND = os.environ.get("XLA_FSDP_MATRIX_MODEL", "stack")
SEED = int(os.environ.get("XLA_FSDP_MATRIX_SEED", "0"))
STEPS = 2               # before the save, and again after it (in the run and each resume)
LR = 1e-2               # RMSprop's first step moves every weight by 10 * lr: 1e-3 for it

RECIPES = ("torch_xla_recipe", "moved_first", "auto_wrap", "grouped_units", "scanned")
OPTIONS = {
    "default": {},
    "offload": {"offload_optimizer": True},
    "dim0": {"shard_param_on_dim_0": True},
    "flat": {"flatten_parameters": True},
    "bf16": {"compute_dtype": torch.bfloat16},
    "no_reshard": {"reshard_after_forward": False},
    "sharding_groups": {},   # groups of half the world, each its own data-parallel replica
}
OPTIMIZERS = {
    "SGD": dict(momentum=0.9), "Adam": {}, "AdamW": dict(weight_decay=0.01), "Adafactor": {},
    "Adagrad": {}, "RMSprop": dict(lr=LR / 10), "Adamax": {}, "NAdam": {}, "RAdam": {}, "Rprop": {},
}
FORMATS = ("sharded", "consolidated", "dcp", "hf")
AXES = {"recipe": RECIPES, "option": tuple(OPTIONS), "optimizer": tuple(OPTIMIZERS),
        "foreach": (False, True), "format": FORMATS, "resumed_at": ("same", "other")}
SUITE_AXES = dict(AXES, optimizer=tuple(o for o in OPTIMIZERS if o != "Rprop"))


class Cell(NamedTuple):
    recipe: str
    option: str
    optimizer: str
    foreach: bool
    format: str
    resumed_at: str

    def __str__(self) -> str:
        return "-".join(str(v) for v in self)


# Cell patterns (None for any value) -> words the refusal must contain. Each refusal is the
# behaviour users get by the choice made in issue 53; nothing else may be refused.
REFUSALS = [
    # Adafactor's update reads the whole parameter (its norm, its row and column means):
    # refused on any shard but a whole parameter in its own shape ([Note: optimizers that
    # read the whole tensor]), which only dim-0 shards of a one-rank group are; a flat shard
    # of one rank is 1-D, which Adafactor does not factor as it does the 2-D parameter
    (dict(optimizer="Adafactor"), "Adafactor's update reads row and column means"),
]


def _pairs(cell: Dict[str, object]) -> Iterator[Tuple[str, object, str, object]]:
    for (a, x), (b, y) in itertools.combinations(cell.items(), 2):
        yield (a, x, b, y) if a < b else (b, y, a, x)


def all_pairs(axes: Dict[str, Sequence] = AXES) -> set:
    return {p for a, b in itertools.combinations(axes, 2) for x in axes[a] for y in axes[b]
            for p in _pairs({a: x, b: y})}


def covering(axes: Dict[str, Sequence] = AXES) -> List[Cell]:
    """Cells in which every value of each axis meets every value of every other axis
    ([Note: covering the matrix]): the product of the two largest axes, each cell's other
    values chosen to cover the most pairs not yet covered, then a cell for each pair left."""
    big = sorted(axes, key=lambda a: -len(axes[a]))[:2]
    uncovered = all_pairs(axes)
    uses = {(a, v): 0 for a in axes for v in axes[a]}

    def complete(cell):
        for axis in axes:
            if axis not in cell:
                cell[axis] = max(axes[axis], key=lambda v: (
                    sum(p in uncovered for p in _pairs({**cell, axis: v})), -uses[axis, v]))
        for axis, value in cell.items():
            uses[axis, value] += 1
        uncovered.difference_update(_pairs(cell))
        return Cell(**{a: cell[a] for a in axes})

    cells = [complete({big[0]: x, big[1]: y}) for x in axes[big[0]] for y in axes[big[1]]]
    while uncovered:
        a, x, b, y = min(uncovered, key=str)
        cells.append(complete({a: x, b: y}))
    return cells


def product(axes: Dict[str, Sequence] = AXES) -> List[Cell]:
    return [Cell(*values) for values in itertools.product(*axes.values())]


def expected_refusal(cell: Cell) -> str:
    """The words the cell's refusal must contain, or "" if it must train."""
    for pattern, words in REFUSALS:
        if all(getattr(cell, k) == v for k, v in pattern.items()):
            return words
    return ""


def _lr(name: str) -> float:
    return OPTIMIZERS[name].get("lr", LR)


def make_optimizer(name: str, foreach: bool, params):
    return getattr(torch.optim, name)(params, foreach=foreach, **dict(
        OPTIMIZERS[name], lr=_lr(name)))


# -- one rank's side of a launch ------------------------------------------------------------------
def _groups(option: str, world: int):
    if option != "sharding_groups" or world == 1:
        return None
    size = max(world // 2, 1)
    return [list(range(i, i + size)) for i in range(0, world, size)]


def wrap(model: torch.nn.Module, recipe: str, option: str, world: int):
    import torch_xla
    import torch_xla.runtime as xr
    from xla_fsdp import FSDP, ScannedLayers
    from xla_fsdp.wrap import transformer_auto_wrap_policy
    kw = dict(OPTIONS[option], pin_layout_in_collective_ops=True)
    groups = _groups(option, world)
    if groups:
        size = len(groups[0])
        kw.update(sharding_groups=groups, sharding_rank=xr.global_ordinal() % size,
                  sharding_world_size=size)
    device = torch_xla.device()
    layers = model.layers
    if recipe == "torch_xla_recipe":   # as torch_xla's docs nest: move, wrap, move the root
        for i in range(len(layers)):
            layers[i] = FSDP(layers[i].to(device), **kw)
        return FSDP(model.to(device), **kw)
    if recipe == "moved_first":
        model = model.to(device)
        for i in range(len(layers)):
            layers[i] = FSDP(layers[i], **kw)
        return FSDP(model, **kw)
    if recipe == "auto_wrap":
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        return FSDP(model, auto_wrap_policy=policy, **kw)
    if recipe == "grouped_units":   # the input layer and the head in one unit
        FSDP([model.inp, model.head], **kw)
        for i in range(len(layers)):
            layers[i] = FSDP(layers[i], **kw)
        return FSDP(model, **kw)
    assert recipe == "scanned", recipe
    model.layers = ScannedLayers(layers, **kw)
    return FSDP(model, **kw)


def _split(option: str, world: int, rank: int) -> Tuple[int, int]:
    """(parts the global batch is cut into, this rank's part)."""
    groups = _groups(option, world)
    split = len(groups[0]) if groups else world
    return split, rank % split


def _backward_as_ranks(model, x, y, split: int, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The unsharded model's loss on (x, y), its gradients set as ``split`` data-parallel
    ranks computing in ``dtype`` reduce theirs ([Note: a low-precision reference reduces as
    the ranks do]): each rank's part in ``dtype``, summed in rank order in ``dtype``."""
    if split == 1:
        loss = loss_fn(KIND, forward_in(model, x, dtype), y)
        loss.backward()
        return loss
    params = [p for p in model.parameters() if p.requires_grad]
    local = len(x) // split
    losses, total = [], None
    for part in range(split):
        loss = loss_fn(KIND, forward_in(model, x[part * local:(part + 1) * local], dtype),
                       y[part * local:(part + 1) * local])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        # a power of two: the division is exact, before the sum or after it
        grads = [(g if g is not None else torch.zeros_like(p)).to(dtype) / split
                 for g, p in zip(grads, params, strict=True)]
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
        losses.append(loss)
    for p, g in zip(params, total, strict=True):
        p.grad = g.float()
    return sum(losses) / split


def _train(model, opt, steps, option: str, world: int, rank: int,
           compute_dtype: Optional[torch.dtype] = None, ranks: int = 1) -> List[float]:
    """Each step's loss (the ranks' mean); ``compute_dtype`` and ``ranks``: how the unsharded
    reference computes and reduces (``_backward_as_ranks``)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    device = torch_xla.device()
    split, part = _split(option, world, rank)
    local = GLOBAL_BATCH // split
    losses = []
    for step in steps:
        x, y = batch(KIND, step + 1000 * SEED)
        x, y = x[part * local:(part + 1) * local], y[part * local:(part + 1) * local]
        opt.zero_grad()
        loss = _backward_as_ranks(model, x.to(device), y.to(device), ranks, compute_dtype)
        opt.step()
        loss = loss.detach()
        if split > 1:
            loss = xm.all_reduce(xm.REDUCE_SUM, loss, scale=1.0 / split,
                                 groups=_groups(option, world))
        torch_xla.sync()
        losses.append(loss.item())
    return losses


def _parameters(model) -> Dict[str, torch.Tensor]:
    from xla_fsdp._sharding.names import clean_name
    return {clean_name(k): v.float() for k, v in model.full_state_dict(rank0_only=False).items()}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _path(root: str, cell: Cell) -> str:
    return os.path.join(root, str(cell), {"consolidated": "full.pth"}.get(cell.format, "ck"))


def _save(cell: Cell, path: str, model, opt) -> None:
    from xla_fsdp.checkpoint import save_consolidated, save_dcp, save_sharded
    if cell.format == "sharded":
        save_sharded(path, model, opt)
    elif cell.format == "dcp":
        save_dcp(path, model, opt)
    elif cell.format == "hf":   # a Hugging Face directory holds the model alone
        save_consolidated(path, model, format="hf")
    else:
        save_consolidated(path, model, opt)


def _load(cell: Cell, path: str, model, opt) -> None:
    from xla_fsdp.checkpoint import load_consolidated, load_dcp, load_sharded
    load = {"sharded": load_sharded, "dcp": load_dcp}.get(cell.format, load_consolidated)
    load(path, model, None if cell.format == "hf" else opt)


def _attempt(what: str, result: Dict, fn):
    """``fn()``, or None with ``result["refused"]`` saying where and why."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a refusal, judged against REFUSALS
        result["refused"] = f"{what}: {_error(exc)}"
        return None


def _wrapped(cell: Cell, world: int, seed: int):
    torch.manual_seed(seed)
    model = wrap(build_model(KIND), cell.recipe, cell.option, world)
    return model, make_optimizer(cell.optimizer, cell.foreach, model.parameters())


def resume(cell: Cell, root: str, world: int, rank: int) -> Dict:
    """A fresh wrapped model (from other initial weights) loads the cell's checkpoint and
    trains the second half of the steps; from a Hugging Face directory, the model alone is
    loaded and compared with what was saved."""
    result = {}
    built = _attempt("construction", result, lambda: _wrapped(cell, world, seed=SEED + 1))
    if built is None:
        return result
    model, opt = built
    _attempt("load", result, lambda: _load(cell, _path(root, cell), model, opt))
    if "refused" in result:
        return result
    if cell.format != "hf":
        losses = _attempt("training on", result, lambda: _train(
            model, opt, range(STEPS, 2 * STEPS), cell.option, world, rank))
        if losses is None:
            return result
        result["losses"] = losses
    result["params"] = _parameters(model)
    return result


def _trained(cell: Cell, root: str, world: int, rank: int) -> Dict:
    """The cell trained at ``world`` ranks, saved, trained on, and resumed here when
    ``resumed_at`` is "same"."""
    result = {}
    built = _attempt("construction", result, lambda: _wrapped(cell, world, seed=SEED))
    if built is None:
        return result
    model, opt = built
    first = _attempt("training", result, lambda: _train(
        model, opt, range(STEPS), cell.option, world, rank))
    if first is None:
        return result
    result["saved_params"] = _parameters(model)
    _attempt("save", result, lambda: _save(cell, _path(root, cell), model, opt))
    if "refused" in result:
        return result
    result["losses"] = first + _train(model, opt, range(STEPS, 2 * STEPS), cell.option,
                                      world, rank)
    result["params"] = _parameters(model)
    if cell.resumed_at == "same":
        result["resumed"] = resume(cell, root, world, rank)
    return result


def _each(rank: int, cells: Sequence[Cell], run, what: str) -> Dict:
    """{cell: run(cell)}, each cell starting clean: a refused step leaves its forward and
    backward pending on the device, and the next sync would run them inside another cell's
    graph, so every rank drops them when the cell is refused. Letting the cell's model die
    was not enough: autograd's device thread may hold a finished backward's tensors a moment
    longer on one rank than on another, and the ranks then met at the sync with different
    work pending (``DivergentGraphs``, once under load in stops 70 and 72)."""
    import gc
    import torch_xla
    import torch_xla.runtime as xr
    out = {}
    for cell in cells:
        if rank == 0:   # an abort's log then names the cell it happened in
            print(f"matrix: {what} {cell} at N={xr.world_size()}", file=sys.stderr, flush=True)
        out[cell] = run(cell)
        if "refused" in out[cell] or "refused" in out[cell].get("resumed", {}):
            torch_xla._XLAC._clear_pending_irs(str(torch_xla.device()))
        gc.collect()
        torch_xla.sync()
    return out


def run_cells(rank: int, cells: Sequence[Cell], root: str) -> Dict:
    """Every cell trained at this launch's world size (see ``_trained``)."""
    import torch_xla.runtime as xr
    world = xr.world_size()
    return _each(rank, cells, lambda cell: _trained(cell, root, world, rank), "training")


def resume_cells(rank: int, cells: Sequence[Cell], root: str) -> Dict:
    """Another world size resumes every cell given (those saved and "resumed_at" other)."""
    import torch_xla.runtime as xr
    world = xr.world_size()
    return _each(rank, cells, lambda cell: resume(cell, root, world, rank), "resuming")


def _compute_dtype(cell: Cell) -> Optional[torch.dtype]:
    return OPTIONS[cell.option].get("compute_dtype")


def reference(rank: int, runs: Sequence[Tuple[str, bool, Optional[torch.dtype], Tuple[int, int]]]
              ) -> Dict:
    """Each (optimizer, foreach, compute dtype, splits)'s run of the unsharded model on one
    device, computing in that dtype as a unit does (``forward_in``); ``splits``: the ranks
    whose reduction a low-precision run's gradients follow before the save and after it
    (``_splits``)."""
    import torch_xla
    device = torch_xla.device()
    out = {}
    for name, foreach, dtype, splits in runs:
        torch.manual_seed(SEED)
        model = build_model(KIND).to(device)
        opt = make_optimizer(name, foreach, model.parameters())
        losses = [loss for half, ranks in enumerate(splits) for loss in _train(
            model, opt, range(half * STEPS, (half + 1) * STEPS), "default", 1, 0, dtype, ranks)]
        # the state, buffers included: a cell's model is compared by its full_state_dict
        out[name, foreach, dtype, splits] = {"losses": losses, "params": {
            k: v.detach().cpu() for k, v in model.state_dict().items()}}
    return out


def _splits(cell: Cell, world: int, later_world: int) -> Tuple[int, int]:
    """The reference's data-parallel parts before the save and after it: one for a float32
    cell, the ranks that sum each gradient for a low-precision one ([Note: a low-precision
    reference reduces as the ranks do])."""
    if precision(_compute_dtype(cell)) == "float32":
        return 1, 1
    return _split(cell.option, world, 0)[0], _split(cell.option, later_world, 0)[0]


@contextlib.contextmanager
def exact_low_precision() -> Iterator[None]:
    """Launches whose programs round every bf16 result to bf16 (XLA's excess precision off;
    see [Note: a low-precision reference reduces as the ranks do])."""
    from xla_fsdp.launch.environment import restored_environment
    with restored_environment(["XLA_FLAGS"]):
        os.environ["XLA_FLAGS"] = " ".join(
            f for f in (os.environ.get("XLA_FLAGS"), "--xla_allow_excess_precision=false") if f)
        yield


# -- judging ---------------------------------------------------------------------------------------
def _moved(optimizer: str, steps: int) -> Optional[float]:
    """Twice the most an adaptive optimizer's steps can move a weight in all, None for SGD
    ([Note: parity bounds]). A step moves a weight by at most lr, except RMSprop's (lr /
    sqrt(1 - alpha), 10 lr, for a gradient above its running root mean square, as every
    first one is) and Rprop's (lr, growing by 1.2 each step)."""
    if optimizer == "SGD":
        return None
    lr = _lr(optimizer)
    if optimizer == "RMSprop":
        return 2 * steps * lr / (1 - 0.99) ** 0.5
    growth = 1.2 if optimizer == "Rprop" else 1.0
    return 2 * lr * sum(growth ** k for k in range(steps))


def differences(cell: Cell, got_losses, got_params, ref_losses, ref_params) -> List[str]:
    """Where a run differs from the reference (which computes in the cell's dtype) beyond
    the suite's parity bounds ([Note: parity bounds] in ``bounds.py``)."""
    key = precision(_compute_dtype(cell))
    return loss_problems(got_losses, ref_losses, key) + parameter_problems(
        got_params, ref_params, key, _moved(cell.optimizer, 2 * STEPS))


def _refusal(result: Dict, expected: str) -> Tuple[str, List[str]]:
    outcome = "refused (" + result["refused"] + ")"
    return outcome, [] if expected and expected in result["refused"] else [outcome]


def judge(cell: Cell, trained: Dict, resumed: Optional[Dict], ref: Optional[Dict],
          resumed_ref: Optional[Dict], resume_world: int) -> Tuple[str, List[str]]:
    """(the cell's outcome for the table, its problems: none when it matched, or was refused
    as ``REFUSALS`` expects). ``resumed`` None: the checkpoint was not resumed (the script's
    ``--other-world 0``); ``ref`` and ``resumed_ref``: the references of the run and of the
    resumed one (``_splits``), None for a cell that must be refused."""
    expected = expected_refusal(cell)
    if "refused" in trained:
        return _refusal(trained, expected)
    if expected:
        return "matched", [f"trained, but should be refused ({expected!r})"]
    problems = differences(cell, trained["losses"], trained["params"], ref["losses"],
                           ref["params"])
    if resumed is None:
        return "matched (not resumed)", problems
    where = f"resumed at N={resume_world}"
    if "refused" in resumed:
        outcome, refused = _refusal(resumed, expected_refusal(cell))
        return f"matched; {where}: {outcome}", problems + refused
    if cell.format == "hf":   # the model alone: exactly what was saved
        problems += [f"{where}: {k} is not what was saved" for k, v in
                     trained["saved_params"].items()
                     if not torch.equal(resumed["params"].get(k, torch.empty(0)), v)]
    else:
        problems += [f"{where}: {p}" for p in differences(
            cell, resumed["losses"], resumed["params"], resumed_ref["losses"][STEPS:],
            resumed_ref["params"])]
    return "matched", problems


def run(cells: Sequence[Cell], world: int = 2, other_world: int = 4):
    """Runs ``cells`` (three launches: the reference, ``world``, ``other_world``); returns
    ({cell: outcome}, {cell: problems} for the cells that failed)."""
    import tempfile
    from xla_fsdp import launch
    def key(cell: Cell, later_world: int):
        return (cell.optimizer, cell.foreach, _compute_dtype(cell),
                _splits(cell, world, later_world))

    later_world = {c: other_world if c.resumed_at == "other" and other_world else world
                   for c in cells}
    # a cell that must be refused is judged without a reference
    runs = {key(c, w): None for c in cells if not expected_refusal(c)
            for w in (world, later_world[c])}
    with exact_low_precision():
        refs = launch(reference, (list(runs),), num_devices=1)[0]
        with tempfile.TemporaryDirectory() as root:
            trained = launch(run_cells, (list(cells), root), num_devices=world)[0]
            later = [c for c in cells if c.resumed_at == "other" and "params" in trained[c]
                     and other_world]
            resumed = launch(resume_cells, (later, root), num_devices=other_world)[0] \
                if later else {}
    outcomes, failures = {}, {}
    for cell in cells:
        got = trained[cell]
        outcomes[cell], problems = judge(
            cell, got, resumed.get(cell, got.get("resumed")), refs.get(key(cell, world)),
            refs.get(key(cell, later_world[cell])), later_world[cell])
        if problems:
            failures[cell] = problems
    return outcomes, failures


def table(outcomes: Dict[Cell, str]) -> str:
    """The note's table: one row per cell."""
    rows = ["| " + " | ".join(Cell._fields) + " | outcome |", "|" + "---|" * 7]
    rows += [f"| {' | '.join(map(str, cell))} | {outcome} |"
             for cell, outcome in outcomes.items()]
    return "\n".join(rows)


if __name__ == "__main__":   # any part of the matrix, outside the suite
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--product", action="store_true",
                        help="every combination of the chosen values, not the covering")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--other-world", type=int, default=4)
    parser.add_argument("--model", choices=("stack", "stack_masked"), default=KIND,
                        help="the model's kind in tests/support/models.py")
    parser.add_argument("--seed", type=int, default=SEED,
                        help="seeds the initial weights and the data")
    for axis, values in AXES.items():
        parser.add_argument(f"--{axis}", nargs="*", default=None,
                            help=f"values (default: all of {list(map(str, values))})")
    args = parser.parse_args()
    os.environ.update(XLA_FSDP_MATRIX_MODEL=args.model, XLA_FSDP_MATRIX_SEED=str(args.seed))
    KIND, SEED = args.model, args.seed
    axes = {axis: [v for v in values if getattr(args, axis) is None
                   or str(v) in getattr(args, axis)] for axis, values in AXES.items()}
    chosen = product(axes) if args.product else covering(axes)
    print(f"{len(chosen)} cells", flush=True)
    outcomes, failures = run(chosen, args.world, args.other_world)
    print(table(outcomes))
    for cell, problems in failures.items():
        print(f"FAILED {cell}: " + "; ".join(problems))
