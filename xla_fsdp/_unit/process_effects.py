"""Everything FSDP changes outside its own objects, installed from here, once per process,
when the first unit is built (never at import):

* the global optimizer step hooks: the guard (``optimizer_guard``), the sync before a
  step's host reads (``step_reads``) and the reissue that keeps donated buffers updated in
  place (``_xla.donation_order``);
* ``torch.xla``, the device module ``torch.utils.checkpoint`` needs for XLA tensors
  (``_xla.torch_device_module``);
* ``ACCELERATE_USE_FSDP=true`` unless set, from the end of each FSDP backward to the next
  optimizer step, so that accelerate does not average sharded gradients across ranks (see
  [Note: telling accelerate the gradients are sharded] in ``optimizer_guard``);
* ``torch.nn.functional``'s ``scaled_dot_product_attention`` and ``softmax`` wrapped, so
  that inside a unit attention keeps no probabilities for backward, and in a low-precision
  unit computes in its dtype (``attention``); outside every unit they are torch's;
* torch_xla's compile backend traces dropout through PyTorch's decomposition, not its own
  kernel, which scales wrongly (see [Note: dropout under torch.compile] in ``_xla.private_api``);
* ``torch.amp.GradScaler`` decides for all ranks at once over FSDP shards (see
  [Note: loss scaling over shards] in ``loss_scaling``), and reads its flags after one sync
  (see [Note: a host read runs the graph behind it again] in ``step_reads``);
* torch's ``clip_grad_norm_`` and torch_xla's ``reduce_gradients`` refuse FSDP shards (see
  [Note: clipping and averaging refused where they are called] in ``optimizer_guard``);
* ``torch._foreach_zero_`` counts its write on XLA tensors, so that FSDP sees an optimizer's
  ``zero_grad(set_to_none=False)`` (see [Note: zeroing gradients with foreach kernels]);
* on a TPU, torch_xla's collective token switched off (see [Note: no collective token on a
  TPU] in ``_sharding.collectives``);
* every module's conversion checked first for the shards it holds placeholders of (see
  [Note: converting a wrapped model] in ``conversions``), and its ``requires_grad_`` set on
  the placeholders it holds too;
* every parameter registered on any module counted, so that a model's first-forward checks
  run again after one (``root_context.count_parameter_registration``);
* Hugging Face's ``save_pretrained`` without a state dict and ``resize_token_embeddings``
  refused on a model inside units (see [Note: save_pretrained inside units] in
  ``hf_model_guard``), once transformers has been imported;
* peft's ``get_peft_model_state_dict`` wrapped so that PEFT adapters save from a model with
  nested units (``peft_names``). It waits for peft: installed on the first unit built once
  peft has been imported, never importing peft itself.
"""
from __future__ import annotations

import functools

from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from .._sharding.collectives import drop_token_on
from .._xla import torch_device_module
from .._xla.donation_order import reissue_in_order
from .._xla.hardware import device_type
from .._xla.private_api import (CollectiveBindings, after_grad_scaler_unscale,
                                before_grad_scaler_reads, check_before_conversion,
                                dropout_decomposed_when_compiled, foreach_zero_counts_as_a_write)
from . import attention, hf_model_guard, peft_names, step_reads
from .conversions import check_member_conversion, placeholders_follow_requires_grad
from .loss_scaling import agree_on_infs
from .module_parameters import held_values_listed
from .root_context import count_parameter_registration
from .shard_group import shard_group_of
from .optimizer_guard import (audit_update, check_accelerate_setting, check_step,
                              count_updates, refuse_local_clipping_and_averaging,
                              withdraw_declaration)

_installed = False


def install() -> None:
    """Called by every unit's constructor; acts on the first call only (peft's names: on
    the first call after peft was imported)."""
    global _installed
    peft_names.install()
    hf_model_guard.install()
    if _installed:
        return
    _installed = True
    register_module_parameter_registration_hook(count_parameter_registration)
    check_before_conversion(check_member_conversion)
    placeholders_follow_requires_grad()
    held_values_listed()
    register_optimizer_step_pre_hook(check_step)
    register_optimizer_step_pre_hook(step_reads.before_step)
    register_optimizer_step_post_hook(audit_update)   # first: it may put the update back
    register_optimizer_step_post_hook(step_reads.after_step)
    register_optimizer_step_post_hook(count_updates)
    register_optimizer_step_post_hook(
        functools.partial(reissue_in_order, lambda p: shard_group_of(p) is not None))
    torch_device_module.register()
    register_optimizer_step_post_hook(withdraw_declaration)
    check_accelerate_setting()
    refuse_local_clipping_and_averaging()
    attention.install()
    dropout_decomposed_when_compiled()
    foreach_zero_counts_as_a_write()
    after_grad_scaler_unscale(agree_on_infs)
    before_grad_scaler_reads(step_reads.before_scaler_reads)
    drop_token_on(device_type(), CollectiveBindings())
