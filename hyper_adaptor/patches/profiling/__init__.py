"""``--profile``: hyper_adaptor's profiler around megatron's train step (features/profiling.py)."""
