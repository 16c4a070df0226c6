"""Backend choice and fallback for the fused ops (level 1).

Every op in ``hyper_adaptor/ops`` has up to three implementations:

- ``npu``: torch_npu's fused operators, imported lazily (the package imports without torch_npu);
- ``fast``: PyTorch's own fused paths (``F.rms_norm``, ``F.scaled_dot_product_attention``, ...) or a
  compiled reference, for CPU and CUDA;
- ``eager``: the plain-PyTorch reference, written for clarity; it serves every shape and dtype.

The first backend tried comes from the platform (npu -> ``npu``, otherwise ``fast``) unless forced with
``--fused-backend`` or ``HYPER_ADAPTOR_OPS_BACKEND``. A backend that cannot serve a call (shape, dtype,
missing library) says why, and the call falls to the next backend in ``FALLBACK`` — with one logged
notice per (op, backend, reason), never an error mid-training.

Written here rather than taken from a library: the fallback chain and its per-op notices are the
product's own behaviour (MindSpeed hard-fails on an unsupported shape; we degrade with a notice).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hyper_adaptor.notice import notice as say

BACKENDS = ("npu", "fast", "eager")
FALLBACK = {"npu": ("npu", "fast", "eager"), "fast": ("fast", "eager"), "eager": ("eager",)}
BACKEND_ENV = "HYPER_ADAPTOR_OPS_BACKEND"

logger = logging.getLogger("hyper_adaptor.ops")
_forced: str | None = None
_noticed: set[tuple[str, str, str]] = set()
OPS: dict[str, Op] = {}  # every op by name, for call counts and docs
# --deterministic-mode: set True by the determinism feature (a "replace" patch, so ``describe`` lists it
# and undo puts False back). A backend whose kernel is not deterministic for a call is then skipped
# (one notice naming the op), and an op left with none refuses the call (NondeterministicOpError).
DETERMINISTIC = False


class NondeterministicOpError(RuntimeError):
    """--deterministic-mode: no backend of this op computes this call deterministically."""


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: unknown fused-op backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


def force_backend(name: str | None) -> None:
    """Force the first backend tried (``None``: back to the platform's choice)."""
    global _forced
    _forced = None if name in (None, "auto") else _check(name, "--fused-backend")


def preferred_backend() -> str:
    if _forced is not None:
        return _forced
    env = os.environ.get(BACKEND_ENV)
    if env and env != "auto":
        return _check(env, BACKEND_ENV)
    from hyper_adaptor import platform

    return "npu" if platform.device_type() == "npu" else "fast"


def notice(op: str, backend: str, reason: str, nxt: str) -> None:
    key = (op, backend, reason)
    if key in _noticed:
        return
    _noticed.add(key)
    message = f"{op}: the {backend} backend cannot serve this call ({reason}); using {nxt}"
    logger.warning(message)
    say(message)


@dataclass(frozen=True)
class Impl:
    """One backend of one op: ``supports(*args, **kwargs)`` returns None when it can serve the call,
    else the reason it cannot; ``fn`` computes it. ``nondeterministic(*args, **kwargs)``: None when the
    kernel gives the same bits for the same inputs on the call's device (with torch's deterministic
    switches on), else why not; asked only under --deterministic-mode."""

    fn: Callable[..., Any]
    supports: Callable[..., str | None] = lambda *a, **k: None
    nondeterministic: Callable[..., str | None] = lambda *a, **k: None


class Op:
    """An op with its backends; calling it dispatches along the fallback chain."""

    def __init__(self, name: str, **impls: Impl):
        unknown = set(impls) - set(BACKENDS)
        if unknown or "eager" not in impls:
            raise ValueError(f"op {name}: backends must be among {BACKENDS} and include eager; got {sorted(impls)}")
        self.name, self.impls = name, impls
        self.calls = {b: 0 for b in impls}  # how often each backend served a call (cheap, for tests)
        OPS[name] = self

    def chain(self, first: str | None = None) -> list[str]:
        return [b for b in FALLBACK[first or preferred_backend()] if b in self.impls] or ["eager"]

    def resolve(self, *args, backend: str | None = None, **kwargs) -> str:
        """The backend that serves this call (noticing each one skipped)."""
        chain = self.chain(backend)
        refused = []
        for i, name in enumerate(chain):
            reason = self.impls[name].supports(*args, **kwargs)
            if reason is None and DETERMINISTIC:
                why = self.impls[name].nondeterministic(*args, **kwargs)
                if why is not None:
                    refused.append(f"{name}: {why}")
                    reason = f"not deterministic under --deterministic-mode: {why}"
            if reason is None:
                return name
            if i + 1 == len(chain) and refused:
                raise NondeterministicOpError(
                    f"{self.name}: --deterministic-mode, and no backend computes this call deterministically "
                    f"({'; '.join(refused)})")
            notice(self.name, name, reason, chain[i + 1] if i + 1 < len(chain) else "eager")
        return "eager"

    def __call__(self, *args, backend: str | None = None, **kwargs):
        chosen = self.resolve(*args, backend=backend, **kwargs)
        self.calls[chosen] += 1
        return self.impls[chosen].fn(*args, **kwargs)


def call_counts() -> dict[str, dict[str, int]]:
    """{op: {backend: calls}} for every op imported so far."""
    return {name: dict(op.calls) for name, op in OPS.items()}


def npu_module():
    """torch_npu, or None when it is not importable (this machine)."""
    try:
        import torch_npu
    except ImportError:
        return None
    return torch_npu


def need_npu_tensor(*tensors) -> str | None:
    if npu_module() is None:
        return "torch_npu is not installed"
    if any(t.device.type != "npu" for t in tensors if t is not None):
        return "tensors are not on an NPU"
    return None


class TriedUntilFailed:
    """A faster kernel ``fn`` tried before ``fallback`` (same arguments, same result contract) until it
    first fails for a reason of its own — ``fails_itself(exc)``: a compiler that cannot run, a kernel the
    device or library lacks. That call and every later one then run ``fallback``, with one notice
    naming ``fallback_name``; ``failed`` says why (None while ``fn`` is tried), ``calls`` counts the
    calls ``fn`` served.

    Any other error (out of memory, a bad shape) is the call's own and propagates, and the next call
    tries ``fn`` again. A failure that looks like the kernel's may still be the call's (dynamo, for one,
    reports a shape bug of the caller as a compiler error): the fallback is run on the same arguments
    before giving up on ``fn``, and if it raises too, its error — the caller's — propagates and ``fn``
    stays in use. One mechanism for every such path (the compiled references, wgrad_accum's half GEMM)."""

    def __init__(self, op: str, name: str, fn: Callable, fallback: Callable, fallback_name: str,
                 fails_itself: Callable[[BaseException], bool]):
        self.op, self.name, self.fn = op, name, fn
        self.fallback, self.fallback_name = fallback, fallback_name
        self.fails_itself = fails_itself
        self.failed: str | None = None
        self.calls = 0

    def reason(self, exc: BaseException) -> str:
        text = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

    def __call__(self, *args):
        if self.failed:
            return self.fallback(*args)
        try:
            result = self.fn(*args)
        except Exception as exc:
            if not self.fails_itself(exc):
                raise
            result = self.fallback(*args)
            self.failed = self.reason(exc)
            notice(self.op, self.name, self.failed, self.fallback_name)
            return result
        self.calls += 1
        return result


class Compiled(TriedUntilFailed):
    """``fn`` under ``torch.compile``, compiled at its first call — the fast backends of rms_norm,
    swiglu and rope. Compilation can only fail when it runs (no C++ compiler, no Triton): that call and
    every later one then run ``fallback`` (``fn`` itself unless given), with one notice naming
    ``fallback_name``. ``failed`` tells callers that pick a whole other path once compilation is out.
    Only a failure of the compiler falls back (:func:`raised_by_compiler`)."""

    def __init__(self, op: str, fn: Callable, fallback: Callable | None = None,
                 fallback_name: str = "the uncompiled function"):
        super().__init__(op, "fast (compiled)", self._run_compiled, fallback or fn, fallback_name,
                         raised_by_compiler)
        self.source = fn
        self._compiled = None

    def compiled(self) -> Callable:
        if self._compiled is None:
            import torch

            self._compiled = torch.compile(self.source)
        return self._compiled

    def _run_compiled(self, *args):
        return self.compiled()(*args)

    def reason(self, exc: BaseException) -> str:
        return f"torch.compile failed: {type(exc).__name__}"


_COMPILER_MODULES = ("torch._dynamo.exc", "torch._inductor.exc")


def raised_by_compiler(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, is one of torch.compile's own (dynamo's
    TorchDynamoException family, inductor's compile errors such as CppCompileError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(cls.__module__ in _COMPILER_MODULES for cls in type(exc).__mro__):
            return True
        exc = exc.__cause__
    return False
