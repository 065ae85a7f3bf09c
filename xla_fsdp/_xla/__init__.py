"""XLA glue: workarounds for torch_xla behaviour that FSDP would otherwise suffer from (buffer
donation order, the weight-saving ``nn.Linear`` backward, the missing ``torch.xla`` device
module), and ``private_api``, the one module that uses torch's and torch_xla's private APIs."""
