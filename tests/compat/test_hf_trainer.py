"""Hugging Face Trainer's XLA FSDP path, unchanged, on xla_fsdp through patch_torch_xla().

The same Trainer run on one device with the whole batch, at N = 4 plain data parallel
(accelerate all-reduces the gradients), and at N = 4 with ``fsdp="full_shard"`` and
``fsdp_config={"xla": True, ...}`` after ``patch_torch_xla()``, so that Trainer's own
imports of torch_xla's FSDP get ours. Same model init, data, SGD with momentum, a decaying
schedule and gradient clipping (which the first steps hit: clipping by each rank's own norm
shows). The logged losses must
agree step by step, and the models Trainer's ``save_model()`` writes must load with
``from_pretrained`` and be equal; each is the best checkpoint's, which
``load_best_model_at_end`` loaded back into the model. The file also runs on transformers 5
(``test_transformers_5.py``), where Trainer lost the line that made this work
([Note: Trainer's wrapped model on transformers 5]). This exercises, through Trainer's public
entry points: wrapping with a transformer-layer policy, accelerate's sharded-gradient
handling (``ACCELERATE_USE_FSDP``), accelerate's pinned all-gather of token counts, the
per-rank save with ``xm.save``, ``consolidate_sharded_model_checkpoints(save_model=False)``
and ``model.module.module``.
"""
import os

import pytest
import torch
# Lazy imports race in device threads: import everything Trainer needs up front.
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
import transformers.trainer  # noqa: F401

from xla_fsdp import launch

from ..support.parity import paired

WORLD, STEPS, LR = 4, 6, 0.1
LOSS_BOUND, PARAM_BOUND = 1e-5, 1e-5


class TokenData(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.tokens = torch.randint(0, 64, (WORLD * 2 * STEPS, 12), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def _config():
    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def run_trainer(rank, out, fsdp, grad_ckpt=False, batch=2, smoothing=0.0, resume=None,
                twice=False, settings=None):
    if fsdp:
        from xla_fsdp import patch_torch_xla
        patch_torch_xla()
    else:  # left by an FSDP unit built earlier in the test process, it would stop DP
        os.environ.pop("ACCELERATE_USE_FSDP", None)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config())
    extra = {}
    if fsdp:
        extra = {"fsdp": "full_shard",
                 "fsdp_config": {"xla": True, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                 "xla_fsdp_settings": settings or {}}}
    args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=batch,
                             learning_rate=LR, lr_scheduler_type="polynomial",
                             lr_scheduler_kwargs={"lr_end": LR / 2, "power": 1.0},
                             weight_decay=0.1,   # LayerNorms and biases undecayed, as plain
                             max_grad_norm=1.0, logging_steps=1, report_to="none",
                             dataloader_drop_last=True, seed=0,
                             gradient_checkpointing=grad_ckpt,
                             # Trainer's label smoother, which shifts a causal LM's labels
                             # ([Note: Trainer's causal-LM check under FSDP]); each rank's
                             # loss a mean over its own tokens, as Trainer's smoother makes it
                             label_smoothing_factor=smoothing,
                             average_tokens_across_devices=not smoothing,
                             # the "best" checkpoint is the first (the higher loss), so the
                             # model saved at the end is step 3's, reloaded by Trainer
                             eval_strategy="steps", eval_steps=3, save_strategy="steps",
                             save_steps=3, load_best_model_at_end=True,
                             metric_for_best_model="eval_loss", greater_is_better=True,
                             **extra)
    # momentum and a decaying rate: what a resume at another world size must carry over
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(),
                      eval_dataset=torch.utils.data.Subset(TokenData(), range(WORLD * 8)),
                      optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": LR, "momentum": 0.9}))
    trainer.train(resume_from_checkpoint=resume)
    if twice:   # [Note: a second train() under XLA FSDP]: on from the trained weights
        trainer.train()
    trainer.save_model(out)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    wrapped = type(trainer.model).__module__
    # accelerate is told the gradients are sharded between an FSDP backward and its step
    # only, so a model trained later in the process gets accelerate's all-reduce (see
    # [Note: telling accelerate the gradients are sharded])
    return {"losses": losses, "wrapped_by": wrapped, "left": os.environ.get("ACCELERATE_USE_FSDP"),
            "best": os.path.basename(trainer.state.best_model_checkpoint)}


@pytest.mark.slow
def test_trainer_fsdp_matches_plain_trainer_and_one_device(tmp_path):
    one_dir, plain_dir = str(tmp_path / "one"), str(tmp_path / "plain")
    one = launch(run_trainer, (one_dir, False, False, 2 * WORLD), num_devices=1)[0]
    plain = launch(run_trainer, (plain_dir, False), num_devices=WORLD)[0]
    _compare(one, one_dir, plain, plain_dir)   # Trainer's own data parallelism is exact
    # without and with Hugging Face's gradient checkpointing (torch.utils.checkpoint inside
    # every wrapped GPT2Block), which recomputes the same values; with it, Trainer's label
    # smoothing, against one device smoothing too
    smoothed_dir = str(tmp_path / "one_smoothed")
    smoothed = launch(run_trainer, (smoothed_dir, False, False, 2 * WORLD, 0.1),
                      num_devices=1)[0]
    for grad_ckpt in (False, True):
        fsdp_dir = str(tmp_path / f"fsdp_ckpt{int(grad_ckpt)}")
        sharded = launch(run_trainer, (fsdp_dir, True, grad_ckpt, 2, 0.1 * grad_ckpt),
                         num_devices=WORLD)[0]
        assert sharded["wrapped_by"] == "xla_fsdp.fully_sharded" and sharded["left"] is None
        if grad_ckpt:
            _compare(smoothed, smoothed_dir, sharded, fsdp_dir)
        else:
            _compare(plain, plain_dir, sharded, fsdp_dir)
            _compare(one, one_dir, sharded, fsdp_dir)
    # resumed on half the devices from step 3 ([Note: Trainer's optimizer at another world
    # size]): its momentum and schedule go on; then trained again ([Note: a second train()
    # under XLA FSDP]). Trainer keeps the checkpoint's batch per device (and warns), so
    # plain Trainer resumed as well is the reference
    resumed = {}
    for fsdp, saved_dir in ((False, plain_dir), (True, str(tmp_path / "fsdp_ckpt0"))):
        resumed[fsdp] = str(tmp_path / f"resumed_fsdp{int(fsdp)}")
        resumed[fsdp, "run"] = launch(run_trainer, (
            resumed[fsdp], fsdp, False, 2, 0.0, os.path.join(saved_dir, "checkpoint-3"), True),
            num_devices=WORLD // 2)[0]
    _compare(resumed[False, "run"], os.path.join(resumed[False], "checkpoint-6"),
             resumed[True, "run"], os.path.join(resumed[True], "checkpoint-6"),
             best="checkpoint-6")
    # resumed on as many devices, its shards cut along dim 0: Trainer's own loader would
    # read each rank's file index by index, so the optimizer state is resharded instead
    # ([Note: Trainer's optimizer at another world size]); it goes on as the run that
    # never stopped
    relaid_dir = str(tmp_path / "relaid")
    relaid = launch(run_trainer, (relaid_dir, True, False, 2, 0.0,
                                  str(tmp_path / "fsdp_ckpt0" / "checkpoint-3"), False,
                                  {"shard_param_on_dim_0": True}), num_devices=WORLD)[0]
    _compare(plain, os.path.join(plain_dir, "checkpoint-6"),
             relaid, os.path.join(relaid_dir, "checkpoint-6"))


def _compare(plain, plain_dir, sharded, fsdp_dir, best="checkpoint-3"):
    """``sharded`` (the run in ``fsdp_dir``) equals ``plain`` (in ``plain_dir``)."""
    assert len(plain["losses"]) == len(sharded["losses"]) == STEPS
    assert plain["best"] == sharded["best"] == best, (plain["best"], sharded["best"])
    for step, (a, b) in paired(sharded["losses"], plain["losses"]):
        assert abs(a - b) <= LOSS_BOUND * abs(b), (step, a, b)
    # Trainer's consolidated save loads into the plain model class, tied weights included
    ours = GPT2LMHeadModel.from_pretrained(fsdp_dir).state_dict()
    theirs = GPT2LMHeadModel.from_pretrained(plain_dir).state_dict()
    assert set(ours) == set(theirs)
    worst = max((ours[k].float() - theirs[k].float()).abs().max().item() for k in theirs)
    assert worst <= PARAM_BOUND, worst
    torch.manual_seed(0)
    initial = GPT2LMHeadModel(_config())
    moved = max((ours[k].float() - initial.state_dict()[k].float()).abs().max().item()
                for k in theirs if k in initial.state_dict())
    assert moved > 1e-3  # training changed the weights, so the comparison means something


def test_fused_adamw_becomes_one_that_runs_on_xla(patched_here, tmp_path):
    """transformers' default optim on torch >= 2.8, which torch refuses on XLA tensors
    ([Note: Trainer's default optimizer on XLA])."""
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], optim="adamw_torch_fused")
    with pytest.warns(UserWarning, match="does not run on XLA devices; using 'adamw_torch'"):
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is torch.optim.AdamW and not kwargs.get("fused"), kwargs
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], optim="sgd")
    assert Trainer.get_optimizer_cls_and_kwargs(args)[0] is torch.optim.SGD


def decay_groups(rank):
    """Trainer's decayed parameters of a wrapped GPT-2 (one unit per block, and flattened
    blocks at weight_decay 0.1 and 0), as the unwrapped model names them."""
    from types import SimpleNamespace

    from xla_fsdp import FSDP, patch_torch_xla, transformer_auto_wrap_policy
    patch_torch_xla()
    import functools
    import torch_xla
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    torch.manual_seed(0)
    plain = GPT2LMHeadModel(_config())
    decay = Trainer.get_decay_parameter_names(SimpleNamespace(args=None), plain)
    out = {"plain": sorted(n for n, _ in plain.named_parameters() if n in decay)}
    listed = {n for n, _ in plain.named_parameters()}   # a tied weight under its first name
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
    for flatten in (False, True):
        model = FSDP(GPT2LMHeadModel(_config()).to(torch_xla.device()),
                     auto_wrap_policy=policy, flatten_parameters=flatten)
        before = [n for n, _ in model.named_parameters()]
        for weight_decay in (0.1, 0.0):
            trainer = SimpleNamespace(args=SimpleNamespace(weight_decay=weight_decay))
            try:
                names = set(Trainer.get_decay_parameter_names(trainer, model))
            except ValueError as exc:
                out[(flatten, weight_decay)] = str(exc)
                continue
            shards = {id(p) for n, p in model.named_parameters() if n in names}
            out[(flatten, weight_decay)] = sorted(
                n for n, s in model.get_original_names_and_sharded_parameters()
                if id(s) in shards and n in listed)
        out[(flatten, "unchanged")] = [n for n, _ in model.named_parameters()] == before
    return out


def test_trainer_decays_the_parameters_it_decays_in_the_plain_model():
    """[Note: Trainer's weight decay inside units]: LayerNorm weights and biases are not
    decayed inside units either; a flattened shard mixing both kinds is refused at any
    weight_decay but 0."""
    out = launch(decay_groups, (), num_devices=2)[0]
    assert any("ln_f" in n for n, _ in GPT2LMHeadModel(_config()).named_parameters())
    assert out["plain"] and not any("ln_" in n or "bias" in n for n in out["plain"])
    assert out[(False, 0.1)] == out["plain"]
    assert out[(False, "unchanged")] and out[(True, "unchanged")]
    assert "holds parameters Trainer decays and parameters it does not" in out[(True, 0.1)]
    assert "flatten_parameters=False" in out[(True, 0.1)]
    assert isinstance(out[(True, 0.0)], list)
