"""A stand-in for triton where it is not installed: importing works, running a kernel does not.

megatron-core imports triton in two ways. Most modules guard the import (``try: import triton ...
except ImportError: HAVE_TRITON = False``) and take a non-triton path when it fails; a few import it
unconditionally at module level (megatron-core main's Mamba2 SSD ops, reached from
``megatron.training`` through ``models/hybrid.py``), so without triton ``import megatron.training``
fails, whatever model is trained. The stand-in answers only the second kind: an import the importing
line is prepared to see fail (inside a ``try`` whose handler catches ImportError) still fails, so every
``HAVE_TRITON``-style flag megatron computes says "no triton" and megatron keeps its own fallbacks;
``importlib.util.find_spec("triton")`` keeps the original lookup (None, but while a stand-in is in sys.modules).

What the unconditional importers do at import time works: ``@triton.jit`` / ``@triton.jit(...)``,
``@triton.autotune(configs=[triton.Config(...)], key=...)``, ``@triton.heuristics(...)``,
``tl.constexpr``, ``triton.__version__`` (``0.0.0``: older than any real triton, so version switches
pick their oldest branch), ``triton.cdiv`` / ``next_power_of_2``, and any other ``triton.*`` /
``tl.*`` name as an object that can be passed around. Calling a kernel (``kernel(...)`` or
``kernel[grid](...)``) or any other triton function raises RuntimeError naming it and triton.

Served through two ``wrap`` patches of the import system (its spec lookup ``importlib._bootstrap._find_spec``
and ``_lock_unlock_module``, which an import of a module already in sys.modules calls while the module's
spec says it is initialising, as a stand-in's always does), so it is listed by ``describe`` and taken
back by ``undo`` like every other patch; it is registered only when triton cannot be found.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import os
import sys
from types import ModuleType

TARGET = "importlib._bootstrap._find_spec"
# called by every import that finds a module in sys.modules whose spec says it is still initialising
LOCK_TARGET = "importlib._bootstrap._lock_unlock_module"
VERSION = "0.0.0"
_MARK = "__hyper_adaptor_triton_standin__"
_HERE = os.path.normcase(os.path.abspath(__file__))
_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


class TritonUnavailableError(RuntimeError):
    """A triton kernel or function was run where triton is not installed."""


def _unavailable(what: str) -> TritonUnavailableError:
    return TritonUnavailableError(f"{what} and triton is not installed: install triton (on a device it "
                                  "supports) or turn off the option that uses this kernel")


class _Kernel:
    """Where a ``@triton.jit`` function would be: it can be decorated, passed and indexed, not run."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__module__ = getattr(fn, "__module__", None)
        self.__doc__ = getattr(fn, "__doc__", None)

    @property
    def kernel_name(self) -> str:
        return f"{self.__module__}.{self.__qualname__}" if self.__module__ else self.__qualname__

    def __call__(self, *args, **kwargs):
        raise _unavailable(f"{self.kernel_name} is a triton kernel")

    def __getitem__(self, grid):
        return self  # kernel[grid](...) launches: the call raises

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self.kernel_name}.{name}")

    def __repr__(self):
        return f"<triton kernel {self.kernel_name} (triton not installed)>"


def _kernel(fn):
    return fn if isinstance(fn, _Kernel) else _Kernel(fn)


class _Absent:
    """Any other triton name: attributes and subscripts give more of the same, calling raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self._name}.{name}")

    def __getitem__(self, item):
        return self

    def __call__(self, *args, **kwargs):
        raise _unavailable(f"{self._name} is part of triton")

    def __repr__(self):
        return f"<{self._name} (triton not installed)>"


def jit(fn=None, **options):
    """``@triton.jit`` and ``@triton.jit(**options)``."""
    return _kernel if fn is None else _kernel(fn)


def autotune(configs=None, key=None, **options):
    return _kernel


def heuristics(values=None):
    return _kernel


class Config:
    def __init__(self, kwargs=None, num_warps=4, num_stages=2, num_ctas=1, **options):
        self.kwargs = dict(kwargs or {})
        self.num_warps, self.num_stages, self.num_ctas = num_warps, num_stages, num_ctas
        self.options = options

    def __repr__(self):
        return f"Config({self.kwargs}, num_warps={self.num_warps}, num_stages={self.num_stages})"


def cdiv(a, b):
    return -(-a // b)


def next_power_of_2(n):
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


class constexpr:  # triton's spelling: an annotation and a value
    def __init__(self, value=None):
        self.value = value.value if isinstance(value, constexpr) else value

    def __repr__(self):
        return f"constexpr[{self.value!r}]"

    def __bool__(self):
        return bool(self.value)

    def __eq__(self, other):
        return self.value == (other.value if isinstance(other, constexpr) else other)

    def __hash__(self):
        return hash(self.value)


_CONTENTS = {
    "triton": {"__version__": VERSION, "jit": jit, "autotune": autotune, "heuristics": heuristics,
               "Config": Config, "cdiv": cdiv, "next_power_of_2": next_power_of_2},
    "triton.language": {"constexpr": constexpr},
}


def _module_getattr(module_name):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return _Absent(f"{module_name}.{name}")
    return __getattr__


class _Spec(importlib.machinery.ModuleSpec):
    """A stand-in's spec reports itself as still initialising, so that an import finding the stand-in in
    sys.modules asks ``_lock_unlock_module`` first, where a guarded importer is told there is no triton."""

    @property
    def _initializing(self):
        return True

    @_initializing.setter
    def _initializing(self, value):
        pass


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        fill(module)


LOADER = _Loader()


def is_standin(module) -> bool:
    return bool(getattr(module, "__dict__", {}).get(_MARK))


def fill(module: ModuleType) -> None:
    name = module.__name__
    module.__dict__.update(_CONTENTS.get(name, {}))
    module.__dict__[_MARK] = True
    module.__getattr__ = _module_getattr(name)
    _SERVED.add(name)
    if name == "triton":  # real triton's package imports its language module
        language = ModuleType("triton.language")
        language.__spec__ = _Spec("triton.language", LOADER, is_package=True)
        language.__path__, language.__loader__ = [], LOADER
        fill(language)
        sys.modules["triton.language"] = module.language = language


def _is_triton(name: str) -> bool:
    return name == "triton" or name.startswith("triton.")


@functools.lru_cache(maxsize=256)
def _guarded_ranges(filename: str) -> tuple[tuple[int, int], ...]:
    """Line ranges of ``try`` bodies in ``filename`` whose handlers catch a failed import."""
    try:
        with open(filename, encoding="utf-8") as source:
            tree = ast.parse(source.read())
    except (OSError, SyntaxError, ValueError):
        return ()

    def catches(handler: ast.ExceptHandler) -> bool:
        if handler.type is None:
            return True
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        return any((t.id if isinstance(t, ast.Name) else getattr(t, "attr", None)) in _IMPORT_ERRORS for t in types)

    ranges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Try | getattr(ast, "TryStar", ast.Try)) and any(map(catches, node.handlers)):
            ranges.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno))
    return tuple(ranges)


def _importer_expects_failure() -> bool:
    """Whether the line that asked for triton sits in a ``try`` that catches ImportError."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith("<frozen importlib") or os.path.normcase(filename) == _HERE
                or filename.endswith(os.path.join("importlib", "__init__.py"))):
            break
        frame = frame.f_back
    if frame is None:
        return False
    line = frame.f_lineno
    return any(first <= line <= last for first, last in _guarded_ranges(frame.f_code.co_filename))


_SERVED: set[str] = set()  # stand-in module names that may still be in sys.modules


def _forget() -> None:
    # An unguarded importer has bound its stand-in by now; dropping it from sys.modules keeps the next
    # guarded `import triton` from finding it there, which would make megatron believe triton exists.
    while _SERVED:
        name = _SERVED.pop()
        if is_standin(sys.modules.get(name)):
            del sys.modules[name]


def wrap_find_spec(find_spec):
    """The ``wrap`` patch's factory: the import system's spec lookup, answering triton's names."""

    @functools.wraps(find_spec)
    def find_spec_with_triton_standin(name, path, target=None):
        if not _is_triton(name):
            if _SERVED:
                _forget()
            return find_spec(name, path, target)
        spec = find_spec(name, path, target)
        parent = sys.modules.get("triton")
        if spec is not None and not is_standin(parent):
            return spec  # the real triton (installed after start-up)
        if _importer_expects_failure():
            return None
        return _Spec(name, LOADER, is_package=True)

    return find_spec_with_triton_standin


def wrap_lock_unlock(lock_unlock):
    """The ``wrap`` patch's factory for an import that finds a stand-in already in sys.modules."""

    @functools.wraps(lock_unlock)
    def lock_unlock_with_triton_standin(name):
        if _is_triton(name) and is_standin(sys.modules.get(name)) and _importer_expects_failure():
            _forget()
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return lock_unlock(name)

    return lock_unlock_with_triton_standin


def patches(feature: str) -> list:
    """The two wraps that serve the stand-in (for a triton that cannot be found)."""
    from hyper_adaptor.patch_manager import Patch

    return [Patch(TARGET, wrap_find_spec, "wrap", feature, rebind_in=()),
            Patch(LOCK_TARGET, wrap_lock_unlock, "wrap", feature, rebind_in=())]
