"""Import-time shims: megatron-core 0.19.2 imports on Python 3.11 without triton.

These run before megatron is imported, so they cannot be Patches (a Patch rebinds a name that
exists; these provide names that do not exist yet) — each is the smallest addition that lets the
import succeed, and each is a no-op where the real thing is present.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import typing

logger = logging.getLogger("hyper_adaptor.compat")

# The one module on megatron.core's import path that needs triton: it is reached from
# pipeline_parallel/schedules.py through moe/paged_stash.py, so `import megatron.core` fails without it.
TRITON_ONLY_MODULE = "megatron.core.transformer.moe.ops.paged_stash"


def _identity_override(method):
    # typing.override (3.12) only marks the method; it changes nothing at run time.
    try:
        method.__override__ = True
    except (AttributeError, TypeError):
        pass
    return method


def install_typing_override() -> bool:
    """megatron.training does ``from typing import override`` (Python 3.12+)."""
    if hasattr(typing, "override"):
        return False
    typing.override = _identity_override
    return True


class _TritonKernelUnavailable:
    """Stands where a triton kernel would be; using it is a clear error, importing it is not."""

    def __init__(self, name):
        self.__name__ = name

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{TRITON_ONLY_MODULE}.{self.__name__} is a triton kernel (MoE paged stash) and triton "
            "is not installed; install triton or leave --moe-paged-stash off"
        )


class _PagedStashStandIn(importlib.abc.Loader, importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRITON_ONLY_MODULE:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        # GLOBAL_BLOCK_SIZE is the page-size constant the real module exports (a plain int).
        module.GLOBAL_BLOCK_SIZE = 1024
        module.paged_stash_copy_kernel = _TritonKernelUnavailable("paged_stash_copy_kernel")
        module.paged_stash_pop_kernel = _TritonKernelUnavailable("paged_stash_pop_kernel")
        module.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
        module.HYPER_ADAPTOR_STAND_IN = True


_STAND_IN = _PagedStashStandIn()


def install_triton_stand_in() -> bool:
    """Without triton, serve megatron's triton-only paged-stash module as a stand-in whose kernels
    raise a clear error when called. With triton installed nothing changes."""
    if importlib.util.find_spec("triton") is not None or _STAND_IN in sys.meta_path:
        return False
    sys.meta_path.insert(0, _STAND_IN)
    return True


def install() -> list[str]:
    """Install every import shim this interpreter needs; returns the notices to log."""
    notices = []
    if install_typing_override():
        notices.append("Python < 3.12: provided typing.override for megatron.training")
    if install_triton_stand_in():
        notices.append(
            f"triton not installed: {TRITON_ONLY_MODULE} is a stand-in (MoE paged stash unavailable)"
        )
    return notices
