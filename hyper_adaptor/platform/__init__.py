"""Accelerator abstraction: which device this process trains on, and how to talk to it.

Everything else in hyper_adaptor asks this package for the device type, the distributed backend,
RNG state and memory figures; nothing outside ``platform/`` and ``patches/`` names ``torch.cuda``.
Only torch (and torch_npu, when present) is imported here.
"""

from __future__ import annotations

import importlib.util
import os

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


def select_device_type(requested: str | None = None) -> str:
    """Fix the device type for this process: ``requested`` ('auto' or None means detect).

    The environment variable HYPER_ADAPTOR_DEVICE overrides detection too, so that processes a
    launcher spawns (checkpoint writers, data workers) make the same choice as their parent.
    """
    global _selected
    choice = requested or os.environ.get(DEVICE_ENV) or "auto"
    if choice == "auto":
        choice = detect_device_type()
    if choice not in DEVICE_TYPES:
        raise ValueError(
            f"--device-type / {DEVICE_ENV} must be one of auto, {', '.join(DEVICE_TYPES)}; got {choice!r}"
        )
    if choice == "npu" and not npu_available():
        raise RuntimeError("--device-type npu was requested but torch_npu is not installed or sees no NPU")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device-type cuda was requested but torch.cuda.is_available() is False")
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
