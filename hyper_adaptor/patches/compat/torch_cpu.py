"""CPU as Megatron's "cuda" device: what level 0 patches in torch on a process without an accelerator.

(These are patches, so they live here and go through the patch manager; ``platform/`` only says which
device this process uses.)

megatron-core addresses its device through ``torch.cuda`` (about 200 ``current_device()`` calls,
``device="cuda"`` literals, streams, events, RNG state). On a CPU-only build those calls assert or,
worse, are queued lazily and never run (``torch.cuda.manual_seed``), which silently disables the
tensor-parallel RNG tracker. Here ``torch.cuda`` answers as one emulated device backed by the host:

* device queries and placement: ``current_device() == 0``, ``device_count() == 1``; tensor factories,
  ``Tensor.to`` / ``Tensor.cuda`` and friends map "cuda", "cuda:N" and bare indices to "cpu" — the
  same mechanism torch_npu's ``transfer_to_npu`` uses to map "cuda" to "npu", chosen over a
  TorchFunctionMode because it holds on every thread (autograd, checkpoint writers) and costs only
  on factory calls;
* streams and events are host no-ops (CPU kernels run synchronously);
* RNG: the "cuda" generator *is* the CPU default generator, so that forking it really changes what
  dropout draws;
* collectives: gloo, the host's backend, refuses gather / scatter shapes that NCCL takes and megatron
  passes (see gloo_collectives.py).

``torch.cuda.is_available()`` keeps saying False: torch itself and user code keep their CPU paths.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types

import torch
import torch.utils._device as torch_device_context

from hyper_adaptor import platform
from hyper_adaptor.patch_manager import Patch
from hyper_adaptor.patches.compat import gloo_collectives

FEATURE = "compat"
_CPU = torch.device("cpu")


def map_device(device):
    """The host device for anything that names the emulated "cuda" device; others unchanged."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str):
        return _CPU if device.split(":", 1)[0] == "cuda" else device
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _factory(original):
    """Wrap a tensor factory so that its ``device=`` keyword lands on the host."""

    @functools.wraps(original)
    def on_host(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs an accelerator; host memory is already "pinned"
        return original(*args, **kwargs)

    return on_host


def _tensor_to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and isinstance(args[0], (str, int, torch.device)) and not isinstance(args[0], bool):
            args = (map_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = map_device(kwargs["device"])
        return original(self, *args, **kwargs)

    return to


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _tensor_pin_memory(self, *args, **kwargs):
    return self


def _tensor_record_stream(original):
    """``Tensor.record_stream(stream)`` tells the CUDA caching allocator that another stream still reads
    the tensor; torch's binding refuses the host's stand-in stream ("unknown parameter type"), which
    megatron's schedule nodes (``--overlap-moe-expert-parallel-comm``) hand it. On the host every
    stream's work has run when the call returns, so there is nothing to record."""

    @functools.wraps(original)
    def record_stream(self, stream):
        if isinstance(stream, HostStream):
            return None
        return original(self, stream)

    return record_stream


_HOST_STREAM = platform.HOST_STREAM
HostEvent, HostStream = platform.HostEvent, platform.HostStream


def _stream_context(stream=None):
    return contextlib.nullcontext()


class _DeviceContext(contextlib.nullcontext):
    """``torch.cuda.device(idx)``: there is one emulated device, selecting it changes nothing."""

    def __init__(self, device=None):
        super().__init__()


def _get_rng_state(device="cuda"):
    return torch.get_rng_state()


def _set_rng_state(new_state, device="cuda"):
    torch.set_rng_state(new_state)


def _manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


class HostDeviceProperties:
    """What ``torch.cuda.get_device_properties`` answers for the host: compute capability 0.0, so
    any "Ampere or newer" check takes its conservative path."""

    name = "cpu"
    gcnArchName = "cpu"  # torch.compile's cache key reads this on non-CUDA builds
    major = 0
    minor = 0

    def __init__(self, device=None):
        import os

        import psutil

        self.total_memory = int(psutil.virtual_memory().total)
        self.multi_processor_count = os.cpu_count() or 1


def _no_op(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


def _peak_memory(*args, **kwargs):
    from hyper_adaptor import platform

    return platform.peak_memory_bytes()


def _current_memory(*args, **kwargs):
    from hyper_adaptor import platform

    return platform.current_memory_bytes()


# Factories that accept device=: each maps "cuda" to the host.
TENSOR_FACTORIES = (
    "empty", "empty_strided", "empty_like", "zeros", "zeros_like", "ones", "ones_like", "full",
    "full_like", "tensor", "as_tensor", "arange", "linspace", "logspace", "eye", "rand", "rand_like",
    "randn", "randn_like", "randint", "randint_like", "randperm", "normal", "scalar_tensor",
)
TENSOR_METHOD_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")

# torch.cuda.<name> -> host implementation.
CUDA_NAMESPACE = {
    "current_device": _zero,
    "device_count": lambda: 1,
    "set_device": _no_op,
    "synchronize": _no_op,
    "current_stream": lambda device=None: _HOST_STREAM,
    "default_stream": lambda device=None: _HOST_STREAM,
    "set_stream": _no_op,
    "Stream": HostStream,
    "Event": HostEvent,
    "stream": _stream_context,
    "device": _DeviceContext,
    "empty_cache": _no_op,
    "is_current_stream_capturing": lambda: False,
    "get_device_name": lambda device=None: "cpu",
    "get_device_capability": lambda device=None: (0, 0),
    "get_device_properties": HostDeviceProperties,
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
    "manual_seed": _manual_seed,
    "manual_seed_all": _manual_seed,
    "memory_allocated": _current_memory,
    "max_memory_allocated": _peak_memory,
    "memory_reserved": _current_memory,
    "max_memory_reserved": _peak_memory,
    "reset_peak_memory_stats": _no_op,
    "memory_stats": lambda device=None: {},
}


def _own_copy(impl, name):
    """torch.compile keys its rules for torch.cuda functions by object identity and refuses one
    object filed under two names, so every emulated function gets an object of its own."""
    if not isinstance(impl, types.FunctionType):
        return impl
    copy = types.FunctionType(impl.__code__, impl.__globals__, name, impl.__defaults__, impl.__closure__)
    copy.__qualname__ = f"emulated_cuda.{name}"
    return copy


def torch_patches() -> list[Patch]:
    """The torch-level patches that make "cuda" mean the host on a CPU-only process."""
    # megatron reaches these through attribute access on torch / torch.cuda; inside torch.cuda the
    # same functions are also bound in submodules (torch.cuda.random.get_rng_state, ...).
    no_rebind = ()
    # torch's default-device context (``with torch.device("meta")``) tells factories apart by identity, in
    # a set it builds once on first use (torch.utils._device._device_constructors, private: listed in
    # platform/torch_private.py). Built while the wraps below are in place it would hold the wrappers, not
    # the functions the context sees called, and every factory would ignore the context (meta-device models
    # built for real). Building it now, before any wrap, keeps torch's own functions in it.
    torch_device_context._device_constructors()
    patches = [
        Patch(f"torch.cuda.{name}", _own_copy(impl, name), "replace", FEATURE, rebind_in=("torch.cuda",))
        for name, impl in CUDA_NAMESPACE.items()
    ]
    patches += [Patch(f"torch.{name}", _factory, "wrap", FEATURE, rebind_in=no_rebind) for name in TENSOR_FACTORIES]
    patches += [
        Patch(f"torch.Tensor.{name}", _factory, "wrap", FEATURE, rebind_in=no_rebind)
        for name in TENSOR_METHOD_FACTORIES
    ]
    patches += [
        Patch("torch.Tensor.to", _tensor_to, "wrap", FEATURE, rebind_in=no_rebind),
        Patch("torch.Tensor.cuda", _tensor_cuda, "replace", FEATURE, rebind_in=no_rebind),
        Patch("torch.Tensor.pin_memory", _tensor_pin_memory, "replace", FEATURE, rebind_in=no_rebind),
        Patch("torch.Tensor.record_stream", _tensor_record_stream, "wrap", FEATURE, rebind_in=no_rebind),
        Patch("torch.Tensor.type", _tensor_type, "replace", FEATURE, rebind_in=no_rebind),
        # megatron.training asserts this CUDA launch-queue setting for TP / CP on pre-Blackwell
        # devices (compute capability < 10, which the host reports); on the host it means nothing.
        Patch("os.environ.CUDA_DEVICE_MAX_CONNECTIONS", "1", "item", FEATURE),
    ]
    # gloo is the host's collective backend: the shapes it refuses but megatron passes
    return patches + gloo_collectives.patches()


# --- legacy type names ---------------------------------------------------------------------------
_LEGACY_TYPE_NAME = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}
_INHERITED_TYPE = torch._C.TensorBase.type
_device_type_names = threading.local()


@contextlib.contextmanager
def device_type_names():
    """While active (on this thread), ``tensor.type()`` with no argument names host float tensors as
    their CUDA type: megatron's optimizers and grad clipping sort parameters by comparing that string
    with 'torch.cuda.FloatTensor' and friends. Only the megatron functions wrapped with it (see
    megatron_core.py) run under it, so nothing else sees the changed answer."""
    depth = getattr(_device_type_names, "depth", 0)
    _device_type_names.depth = depth + 1
    try:
        yield
    finally:
        _device_type_names.depth = depth


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    # Installed once (a Patch, so describe lists it and undo removes it) rather than swapped in and
    # out around each call: it answers differently only inside device_type_names().
    if dtype is None and not kwargs:
        if getattr(_device_type_names, "depth", 0) and self.device.type == "cpu" and self.dtype in _LEGACY_TYPE_NAME:
            return _LEGACY_TYPE_NAME[self.dtype]
        return _INHERITED_TYPE(self)
    return _INHERITED_TYPE(self, dtype, non_blocking, **kwargs)
