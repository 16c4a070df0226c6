"""Seams of megatron's optimizer factory served by ``hyper_adaptor.optim``."""
