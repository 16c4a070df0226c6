"""``--moe-dispatcher-engine hyper``: megatron's ``MoELayer`` dispatching tokens through hyper_adaptor/parallel/expert."""
