"""``--moe-dispatcher-engine hyper``: megatron's ``MoELayer`` dispatching through hyper_adaptor/parallel/expert."""
