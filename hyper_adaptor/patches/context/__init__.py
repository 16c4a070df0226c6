"""``--context-parallel-size`` on megatron's local spec, over hyper_adaptor/parallel/context."""
