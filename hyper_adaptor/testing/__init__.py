"""Helpers shared by the test suite and the benchmarks (``bench/`` never imports ``tests/``).

Nothing here imports megatron when imported; see :mod:`hyper_adaptor.testing.world`. What the benches
measure with (collectives, peak memory, result files) is :mod:`hyper_adaptor.testing.measure`, imported by
name (it imports torch).
"""

from hyper_adaptor.testing.world import WorldError, free_port, run_world

__all__ = ["WorldError", "free_port", "run_world"]
