"""Import-time shims: megatron-core 0.19.x and main import on Python 3.11 without triton.

These are applied before megatron is imported, as patches of their own kinds: ``provide`` for a name
the standard library lacks, ``module`` for a megatron module that cannot be imported here. Each is
the smallest addition that lets the import succeed, and none is registered where the real thing is
present.
"""

from __future__ import annotations

import importlib.util
import sys
import typing

from hyper_adaptor.patch_manager import Patch
from hyper_adaptor.patches.compat import triton_standin

FEATURE = "compat"

def _identity_override(method):
    # typing.override (3.12) only marks the method; it changes nothing at run time.
    try:
        method.__override__ = True
    except (AttributeError, TypeError):
        pass
    return method


# emerging_optimizers (megatron's Muon) imports its triton kernels (a fused X X^T for Newton-Schulz, used
# only when asked for with use_syrk, which megatron never does) at import time: without triton the whole
# package, and with it megatron.core.optimizer once the package is installed, fails to import.
EO_TRITON_MODULE = "emerging_optimizers.triton_kernels"


class _SyrkUnavailable:
    def __init__(self, name):
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{EO_TRITON_MODULE}.{self.__name__} is a triton kernel and triton is not installed "
                           "(megatron's Muon does not call it; use_syrk=False)")


def fill_eo_triton_kernels(module) -> None:
    # HAS_TRITON_340 False is the package's own "no usable triton" answer: use_syrk falls back to torch.
    module.HAS_TRITON_340 = False
    module.tsyrk_ex = _SyrkUnavailable("tsyrk_ex")
    module.tsyrk_ex_small_matrix = _SyrkUnavailable("tsyrk_ex_small_matrix")
    module.__all__ = ["HAS_TRITON_340", "tsyrk_ex", "tsyrk_ex_small_matrix"]


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def patches() -> list[Patch]:
    """The import shims this interpreter needs (none on Python >= 3.12 with triton installed)."""
    result = []
    if not hasattr(typing, "override"):  # megatron.training does `from typing import override`
        result.append(Patch("typing.override", _identity_override, "provide", FEATURE, rebind_in=()))
    if not _installed("triton"):
        # megatron-core imports triton unconditionally in modules megatron.core and megatron.training reach
        # (0.19's MoE paged stash, main's SSM ops): the stand-in serves them, their kernels name triton when called
        result += triton_standin.patches(FEATURE)
    if _installed("emerging_optimizers") and not _installed("triton") and EO_TRITON_MODULE not in sys.modules:
        result.append(Patch(EO_TRITON_MODULE, fill_eo_triton_kernels, "module", FEATURE))
    return result


def install():
    """For code that imports megatron.core without the adaptor (dataset tools, benchmarks): apply the
    import shims with a patch manager of their own and return it (``.undo()`` takes them back). The
    adaptor's bootstrap registers none of them again once they are in place."""
    from hyper_adaptor.patch_manager import PatchManager

    manager = PatchManager()
    manager.register_all(patches())
    manager.apply()
    return manager
