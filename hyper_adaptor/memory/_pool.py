"""Host buffers for swapped activations, reused from one step to the next.

Page-locking host memory is slow (it maps and pins pages), and a training step swaps the same shapes
every step, so buffers are kept by size and handed out again instead of being allocated afresh.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from hyper_adaptor import platform


class SwapBufferPool:
    """Flat uint8 host buffers, free lists keyed by exact byte size.

    Not HSDP's :class:`hyper_adaptor.parallel.hsdp.HostBufferPool`, although both keep host memory for
    reuse: that one is a bounded cache of unpinned CPU buffers for collectives, handing out the smallest
    block that fits as a view and forgetting blocks beyond ``keep``; this one owns page-locked staging
    buffers for device <-> host copies, which must be given back whole, are reused only at their exact
    size (a step swaps the same shapes every time) and stay until :meth:`clear`.

    ``acquire(n)`` returns a free buffer of ``n`` bytes (or allocates one); ``release(buf)`` gives it back.
    The caller orders reuse: a buffer released after its last copy was *issued* on the copy stream may be
    handed to a later copy on the same stream, which runs after it (stream order).
    """

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = platform.pin_memory_available() if pin is None else pin
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._all: dict[int, torch.Tensor] = {}   # data_ptr -> buffer, every buffer this pool owns
        self.allocations = 0                      # buffers ever allocated (a reused step adds none)
        self.acquisitions = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        self.acquisitions += 1
        free = self._free[nbytes]
        if free:
            return free.pop()
        buf = platform.host_buffer(nbytes, pin=self.pin)
        self._all[buf.data_ptr()] = buf
        self.allocations += 1
        return buf

    def release(self, buf: torch.Tensor) -> None:
        if buf.data_ptr() not in self._all:
            raise ValueError("SwapBufferPool.release: this buffer was not acquired from this pool")
        self._free[buf.numel()].append(buf)

    def owns(self, data_ptr: int) -> bool:
        return data_ptr in self._all

    @property
    def total_bytes(self) -> int:
        return sum(b.numel() for b in self._all.values())

    @property
    def free_bytes(self) -> int:
        return sum(b.numel() for bufs in self._free.values() for b in bufs)

    def clear(self) -> None:
        """Drop every free buffer (buffers in use stay with their groups)."""
        for bufs in self._free.values():
            for b in bufs:
                self._all.pop(b.data_ptr(), None)
        self._free.clear()
