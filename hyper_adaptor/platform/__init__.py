"""Accelerator abstraction: which device this process trains on, and how to talk to it.

Everything else in hyper_adaptor asks this package for the device type, the distributed backend,
RNG state and memory figures; nothing outside ``platform/`` and ``patches/`` names ``torch.cuda``.
Only torch (and torch_npu, when present) is imported here.
"""

from __future__ import annotations

import importlib.util
import os
import time

import torch

DEVICE_TYPES = ("npu", "cuda", "cpu")
BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
DEVICE_ENV = "HYPER_ADAPTOR_DEVICE"

_selected: str | None = None


def npu_available() -> bool:
    """True when torch_npu is importable and reports at least one NPU."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


def detect_device_type() -> str:
    """npu, then cuda, then cpu — the first one this process can really use."""
    if npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


class DeviceChoiceError(ValueError):
    """The device asked for (``--device-type`` or HYPER_ADAPTOR_DEVICE) is unknown or not usable here;
    the message names the flag or the variable it came from."""


def select_device_type(requested: str | None = None) -> str:
    """Fix the device type for this process: ``requested`` ('auto' or None means detect).

    The environment variable HYPER_ADAPTOR_DEVICE overrides detection too, so that processes a
    launcher spawns (checkpoint writers, data workers) make the same choice as their parent.
    """
    global _selected
    source = "argument --device-type" if requested else DEVICE_ENV
    choice = requested or os.environ.get(DEVICE_ENV) or "auto"
    if choice not in ("auto",) + DEVICE_TYPES:
        hint = "; they are lower case" if choice.lower() in DEVICE_TYPES else ""
        raise DeviceChoiceError(
            f"{source}: invalid choice: {choice!r} (choose from auto, {', '.join(DEVICE_TYPES)}{hint})"
        )
    if choice == "auto":
        choice = detect_device_type()
    asked = f"--device-type {choice}" if requested else f"{DEVICE_ENV}={choice}"
    if choice == "npu" and not npu_available():
        raise DeviceChoiceError(f"{asked} was requested but torch_npu is not installed or sees no NPU")
    if choice == "cuda" and not torch.cuda.is_available():
        raise DeviceChoiceError(
            f"{asked} was requested but torch.cuda.is_available() is False "
            f"(no CUDA build of torch, or no visible GPU); use cpu or auto"
        )
    _selected = choice
    os.environ[DEVICE_ENV] = choice
    return choice


def device_type() -> str:
    """The device type of this process (selected on first use)."""
    return _selected or select_device_type()


def distributed_backend(dev: str | None = None) -> str:
    return BACKENDS[dev or device_type()]


def device_module(dev: str | None = None):
    """torch.cuda, torch.npu or torch.cpu: the module with the device's stream/RNG functions."""
    return getattr(torch, dev or device_type())


def current_device(dev: str | None = None) -> torch.device:
    """This process's device: ``cpu``, or the accelerator at the device module's current index."""
    dev = dev or device_type()
    return torch.device("cpu") if dev == "cpu" else torch.device(dev, device_module(dev).current_device())


def synchronize() -> None:
    device_module().synchronize()


def peak_memory_bytes() -> int:
    """Peak memory this process has used on its device.

    On CPU this is the peak resident set size of the process (what the machine really paid), since
    torch keeps no allocator statistics for host memory.
    """
    dev = device_type()
    if dev == "cpu":
        import resource

        # the kernel updates its high-water mark lazily; never report a peak below the present
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, current_memory_bytes())
    return int(device_module(dev).max_memory_allocated())


def current_memory_bytes() -> int:
    dev = device_type()
    if dev == "cpu":
        import psutil

        return int(psutil.Process().memory_info().rss)
    return int(device_module(dev).memory_allocated())


# --------------------------------------------------------------------------------------------------
# Streams, events and host memory for copies that overlap compute (activation swap, optimizer offload).
#
# On cuda and npu these are the device module's own Stream / Event (torch.cuda.*, torch.npu.* — the same
# documented API on both). On cpu there is no second queue: a copy runs synchronously on the calling
# thread when it is issued, so ``HostStream`` and ``HostEvent`` are stand-ins whose ordering calls are
# no-ops and whose events are complete as soon as they are recorded. Code written against these
# helpers is therefore correct on every device, and it overlaps copies with compute where the device can.


class HostEvent:
    """A device event on the host (also ``torch.cuda.Event`` on a CPU-only process, patches/compat/torch_cpu.py):
    the work it marks has already run when it is recorded."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end_event):
        return (end_event._time - self._time) * 1000.0


class HostStream:
    """A device stream on the host (also ``torch.cuda.Stream`` on a CPU-only process): one in-order queue,
    work issued "on" it runs synchronously, so every wait is already satisfied."""

    device = torch.device("cpu")
    cuda_stream = 0

    def __init__(self, device=None, priority=0, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or HostEvent()
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, HostStream)

    def __hash__(self):
        return 0


HOST_STREAM = HostStream()
_copy_streams: dict = {}


def copies_are_async(dev: str | None = None) -> bool:
    """True where a copy stream really runs beside compute (cuda, npu); False on cpu."""
    return (dev or device_type()) != "cpu"


def new_stream(dev: str | None = None):
    dev = dev or device_type()
    return HOST_STREAM if dev == "cpu" else device_module(dev).Stream()


def current_stream(dev: str | None = None):
    dev = dev or device_type()
    return HOST_STREAM if dev == "cpu" else device_module(dev).current_stream()


def copy_stream(dev: str | None = None):
    """The process's side stream for host<->device copies (one per device type and device index)."""
    dev = dev or device_type()
    if dev == "cpu":
        return HOST_STREAM
    key = (dev, device_module(dev).current_device())
    if key not in _copy_streams:
        _copy_streams[key] = device_module(dev).Stream()
    return _copy_streams[key]


def new_event(dev: str | None = None):
    dev = dev or device_type()
    return HostEvent() if dev == "cpu" else device_module(dev).Event()


def use_stream(stream):
    """``with use_stream(s):`` makes ``s`` the current stream (a no-op for the cpu stand-in)."""
    import contextlib

    if stream is None or isinstance(stream, HostStream):
        return contextlib.nullcontext()
    return device_module(device_type()).stream(stream)


stream = use_stream  # ``with platform.stream(s):``, as torch.cuda.stream / torch.npu.stream


def pin_memory_available(dev: str | None = None) -> bool:
    """Whether host buffers should be page-locked: only with an accelerator to copy to and from
    (pinning needs the accelerator's runtime; on a cpu-only process there is nothing to speed up)."""
    return (dev or device_type()) != "cpu"


def host_buffer(nbytes: int, pin: bool | None = None) -> torch.Tensor:
    """A flat uint8 host tensor of ``nbytes`` bytes, page-locked where that helps."""
    pin = pin_memory_available() if pin is None else pin
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)


def get_platform():
    """HyperParallel's ``get_platform()``: the platform of this process's device. Here that is this module:
    one set of functions (``device_type()``, ``distributed_backend()``, ``current_device()``, streams,
    events, memory figures) that answer for the selected device type (npu, cuda or cpu), rather than one
    class per device, so the returned object is the same whichever device was detected."""
    import sys

    return sys.modules[__name__]
