"""``--use-hsdp``: hyper_adaptor's HSDP engine in place of megatron's DDP wrapper and optimizer sharding."""
