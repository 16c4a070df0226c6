"""Parallel engines (HSDP, context parallel, pipeline schedules): plain torch and torch.distributed, no
megatron import (docs/design.md).

``ContextParallel`` (hyper_adaptor.parallel.context) is re-exported lazily: importing this package stays
free of torch.distributed, like ``hsdp``, which is reached as ``hyper_adaptor.parallel.hsdp``.
"""

__all__ = ["ContextParallel"]


def __getattr__(name):
    if name == "ContextParallel":
        from hyper_adaptor.parallel.context import ContextParallel

        return ContextParallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
