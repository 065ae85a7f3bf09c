"""Train a small GPT-style language model with FSDP, end to end.

    python examples/train_lm.py                      # 4 virtual CPU devices, a few minutes
    python examples/train_lm.py --devices 2 --resume # continue on another device count

The text is the Python standard library's own source, read as bytes (a 256-token vocabulary),
so nothing is downloaded. Every transformer block is its own FSDP unit; the embedding is tied
to the output head. A ``CheckpointManager`` writes per-rank checkpoints to OUT/ckpt/stepNNNNNN
every --checkpoint-every steps (on a background thread with --async-save, the last
--keep-last kept); a run continues from the latest one whenever there is one, at any device
count. SIGTERM (a preemption notice) saves the current step and ends the run with exit code
143; running the same command again continues from there. At the
end the last checkpoint is consolidated with the project's own tool, the result is loaded into
the plain, unwrapped model on the CPU, and the evaluation loss is computed again there: the two
numbers must agree. The loss curve is written to OUT/loss.csv (and OUT/loss.png when
matplotlib is installed).
"""
from __future__ import annotations

import argparse
import csv
import functools
import glob
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from xla_fsdp import launch  # noqa: E402

RESUME_FAILED = "cannot resume from"   # how a damaged checkpoint's error starts


# -- data ---------------------------------------------------------------------------------
def stdlib_bytes(limit: int = 3_000_000) -> torch.Tensor:
    """Up to ``limit`` bytes of the standard library's .py files, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, size = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def batch_at(data: torch.Tensor, step: int, batch: int, seq: int, seed: int) -> tuple:
    """The global batch of ``step``: the same on every rank and in every run."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
    x = torch.stack([data[s:s + seq] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + seq + 1] for s in starts.tolist()])
    return x, y


# -- model --------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attn)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, seq: int, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)  # N(0, 1) would make the first logits huge

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        return self.head(self.ln(self.blocks(x)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)
    return GPT(args.layers, args.dim, args.heads, args.seq)


# -- training on each rank ----------------------------------------------------------------
def wrap(model: GPT, args: argparse.Namespace):
    from xla_fsdp import FSDP, checkpoint_module
    from xla_fsdp.wrap import transformer_auto_wrap_policy
    options = {}
    if args.bf16:
        options.update(compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)
    if args.flatten:
        options.update(flatten_parameters=True)
    if args.dim0:  # the AWS Neuron setting: shard along dim 0, never flatten
        options.update(shard_param_on_dim_0=True)
    if args.offload_optimizer:  # shards, gradients and AdamW's state in host memory
        options.update(offload_optimizer=True)
    def wrapper(m, *a, **kw):
        return FSDP(checkpoint_module(m) if args.activation_checkpointing else m, *a, **kw)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    return FSDP(model, auto_wrap_policy=policy, auto_wrapper_callable=wrapper, **options)


def evaluate(model, data: torch.Tensor, args: argparse.Namespace, rank: int, world: int,
             device) -> float:
    """Mean loss over fixed held-out batches, averaged across ranks."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for i in range(args.eval_batches):
            x, y = batch_at(data, i, args.batch, args.seq, seed=-1)
            local = args.batch // world
            x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
            total = total + lm_loss(model(x.to(device)), y.to(device))
    total = xm.all_reduce(xm.REDUCE_SUM, total, scale=1.0 / (world * args.eval_batches))
    torch_xla.sync()
    return total.item()


def train(rank: int, args: argparse.Namespace) -> dict:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from xla_fsdp.checkpoint import PREEMPTED_EXIT_CODE, CheckpointError, CheckpointManager

    device, world = torch_xla.device(), xr.world_size()
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} must divide by the {world} devices")
    data = stdlib_bytes()
    split = int(len(data) * 0.95)
    train_data, eval_data = data[:split], data[split:]
    model = wrap(build_model(args), args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    manager = CheckpointManager(os.path.join(args.out, "ckpt"), every=args.checkpoint_every,
                                keep_last=args.keep_last, async_save=args.async_save)
    start, history, resumes = 0, [], []
    try:   # the newest step every rank sees, written at any device count, resharded
        extra = manager.restore(model, opt, missing_ok=True)
    except CheckpointError as exc:
        raise CheckpointError(f"{RESUME_FAILED} step {manager.latest()}: {exc}") from None
    if manager.restored_step is not None:
        start = manager.restored_step
        history, resumes = extra["history"], extra.get("resumes", []) + [start]
        if rank == 0:
            print(f"resumed from step {start} ({len(history)} logged losses)", file=sys.stderr)
    elif args.resume:
        from xla_fsdp.aot import planning
        raise SystemExit("--resume: a plan reads no checkpoint; plan without --resume"
                         if planning() else f"--resume: no checkpoint in {manager.directory.root}")
    local = args.batch // world
    shown = rank == 0
    began, tokens = time.monotonic(), 0
    for step in range(start, args.steps):
        x, y = batch_at(train_data, step, args.batch, args.seq, args.seed)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        opt.zero_grad()
        loss = lm_loss(model(x.to(device)), y.to(device))
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        loss = xm.all_reduce(xm.REDUCE_SUM, loss.detach(), scale=1.0 / world)
        torch_xla.sync()
        tokens += args.batch * args.seq
        if step % args.log_every == 0 or step == args.steps - 1:
            value = loss.item()
            history.append((step, value))
            if shown:
                rate = tokens / (time.monotonic() - began)
                done = (step + 1) / args.steps
                bar = "#" * int(24 * done)
                line = (f"step {step + 1:>5}/{args.steps} [{bar:<24}] loss {value:.3f} "
                        f"{rate:,.0f} tokens/s")
                # redrawn in place on a terminal, a line each in a log file
                sys.stderr.write(f"\r{line}" if args.terminal else f"{line}\n")
                sys.stderr.flush()
        manager.maybe_save(step + 1, model, opt, extra={"history": history, "resumes": resumes})
        if manager.stop_requested:  # SIGTERM: every rank saved this step; stop cleanly
            if shown:
                past_bar = "\n" if args.terminal else ""
                print(f"{past_bar}preempted: saved step {step + 1}; run the same command to "
                      f"continue", file=sys.stderr)
            sys.exit(PREEMPTED_EXIT_CODE)
    # unless just saved
    manager.save(args.steps, model, opt, extra={"history": history, "resumes": resumes})
    manager.close()
    if shown and args.terminal:   # past the progress line
        sys.stderr.write("\n")
    return {"eval_loss": evaluate(model, eval_data, args, rank, world, device),
            "history": history, "resumed_from": start, "resumes": resumes}


# -- the parent process -------------------------------------------------------------------
def consolidate_and_check(args: argparse.Namespace, sharded_eval: float) -> None:
    """Consolidates the last checkpoint and recomputes the eval loss in plain PyTorch."""
    from xla_fsdp.checkpoint.consolidate import run
    from xla_fsdp.checkpoint.consolidate.cli import parse_args as consolidate_args
    from xla_fsdp.checkpoint.manager.manager import SHARDED_PREFIX
    latest = open(os.path.join(args.out, "ckpt", "latest")).read().strip()
    prefix = os.path.join(args.out, "ckpt", latest, SHARDED_PREFIX)
    final = os.path.join(args.out, "model_consolidated.pth")
    if os.path.exists(final):
        os.remove(final)  # from an earlier run
    run(consolidate_args(["--ckpt_prefix", prefix, "--save_path", final]))
    model = build_model(args)
    model.load_state_dict(torch.load(final, weights_only=True)["model"], strict=True)
    model.eval()
    data = stdlib_bytes()
    eval_data = data[int(len(data) * 0.95):]
    with torch.no_grad():
        losses = [lm_loss(model(x), y).item() for x, y in
                  (batch_at(eval_data, i, args.batch, args.seq, seed=-1)
                   for i in range(args.eval_batches))]
    plain = sum(losses) / len(losses)
    print(f"eval loss: sharded on XLA {sharded_eval:.5f}, consolidated in plain PyTorch "
          f"{plain:.5f} (difference {abs(plain - sharded_eval):.1e})")
    if abs(plain - sharded_eval) > 1e-3 * max(1.0, abs(plain)):
        raise SystemExit("the consolidated model does not reproduce the sharded model's loss")


def write_curve(args: argparse.Namespace, history: list, eval_loss: float,
                resumes: list) -> None:
    path = os.path.join(args.out, "loss.csv")
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss"])
        writer.writerows(history)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"loss curve: {path} (for loss.png too: pip install -e '.[example]', which "
              f"adds matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in history], [v for _, v in history], label="training loss")
    ax.plot([args.steps], [eval_loss], "o", label=f"evaluation loss {eval_loss:.3f}")
    for i, step in enumerate(resumes):
        ax.axvline(step, color="grey", linestyle=":", label="resumed" if i == 0 else None)
    ax.set_yscale("log")   # the first drop would flatten the rest
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.legend()
    ax.set_title("GPT on Python stdlib source, FSDP")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "loss.png"), dpi=100)
    print(f"loss curve: {path} and {os.path.join(args.out, 'loss.png')}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=None,
                   help="devices to use (default: all accelerators, else 4 virtual CPU devices)")
    p.add_argument("--steps", type=int, default=300,
                   help="train up to this step (default: %(default)s)")
    p.add_argument("--out", default="runs/train_lm",
                   help="checkpoints, loss.csv and loss.png go here (default: %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="fail unless there is a checkpoint to continue from (a run continues "
                        "from OUT/ckpt's latest checkpoint whenever there is one, at any "
                        "device count)")
    p.add_argument("--checkpoint-every", type=int, default=100,
                   help="save a checkpoint every N steps (default: %(default)s)")
    p.add_argument("--keep-last", type=int, default=None,
                   help="keep only the last K checkpoints (default: all)")
    p.add_argument("--async-save", action="store_true",
                   help="write checkpoints on a background thread while training goes on")
    p.add_argument("--log-every", type=int, default=10,
                   help="record the loss every N steps (default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default: %(default)s)")
    p.add_argument("--dim", type=int, default=128, help="model width (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    p.add_argument("--seq", type=int, default=64,
                   help="tokens (bytes) per sequence (default: %(default)s)")
    p.add_argument("--batch", type=int, default=16,
                   help="global batch, sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="AdamW's learning rate (default: %(default)s)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="batches in the evaluation (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="data order (default: %(default)s)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 reduce-scatter")
    p.add_argument("--flatten", action="store_true", help="flatten_parameters=True")
    p.add_argument("--dim0", action="store_true",
                   help="shard_param_on_dim_0=True (the AWS Neuron setting)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each layer's activations in backward")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="offload_optimizer=True: the optimizer steps on the host")
    args = p.parse_args(argv)
    # asked here: a device process's stderr is the launcher's pipe, never a terminal
    args.terminal = sys.stderr.isatty()
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from xla_fsdp.checkpoint import CheckpointError
    from xla_fsdp.launch import LaunchError, accelerator_type
    world = args.devices or (None if accelerator_type() else 4)
    began = time.monotonic()
    try:
        results = launch(train, (args,), num_devices=world)
    except LaunchError as exc:
        if not isinstance(exc.__cause__, CheckpointError):
            raise
        ckpt = os.path.join(args.out, "ckpt")
        if str(exc.__cause__).startswith(RESUME_FAILED):   # the checkpoint itself is damaged
            raise SystemExit(f"\ntrain_lm.py: {exc.__cause__}\nThat checkpoint cannot be "
                             f"read. Move its step directory out of {ckpt} to continue from "
                             f"the checkpoint before it, or pass another --out to start "
                             f"afresh.") from None
        # a save that failed (a full disk) left the earlier checkpoints as they were
        raise SystemExit(f"\ntrain_lm.py: {exc.__cause__}\nTo continue from the last complete "
                         f"checkpoint (named in {os.path.join(ckpt, 'latest')}), free some "
                         f"space and run the same command again.") from None
    first = results[0]
    history = first["history"]
    if first["resumed_from"] >= args.steps:
        print(f"nothing to train: {os.path.join(args.out, 'ckpt')} already holds step "
              f"{first['resumed_from']} (--steps {args.steps}); pass a larger --steps to train "
              f"on, or another --out to start afresh. Its last checkpoint, checked again:")
    else:
        print(f"trained steps {first['resumed_from']} to {args.steps} on {len(results)} "
              f"device(s) in {time.monotonic() - began:.0f}s: loss {history[0][1]:.3f} at step "
              f"{history[0][0]} -> {history[-1][1]:.3f} at step {history[-1][0]}")
    consolidate_and_check(args, first["eval_loss"])
    write_curve(args, history, first["eval_loss"], first["resumes"])


if __name__ == "__main__":
    main()
