"""The CPU buffer pool HSDP's collectives draw their large transient buffers from.

One pool per :class:`~hyper_adaptor.parallel.hsdp._mesh.HSDPMesh` by default, so every unit wrapped
over the same process groups (the layers and the root of one model) shares it; ``hsdp(...,
buffer_pool=...)`` / ``fully_shard(..., buffer_pool=...)`` give a module a pool of its own.
"""

from __future__ import annotations

import torch


class HostBufferPool:
    """Keeps the large transient communication buffers of HSDP on the CPU between uses.

    The CUDA / NPU caching allocators keep freed blocks reserved for the next allocation; torch's CPU
    allocator hands large blocks back to the operating system, so a buffer the size of the whole
    model, allocated afresh each step, page-faults all of it in again (docs/features/hsdp.md gives what
    that costs). This pool does what a caching allocator does, for
    HSDP's own buffers only and only on the CPU: a block given back after its last use is handed out
    again to the next request it fits. At most ``keep`` blocks per dtype stay reserved (``keep=0``:
    none, every buffer is allocated afresh); their bytes are reported by :meth:`reserved_bytes`
    (bench/hsdp.py prints them beside the model state). Only buffers whose every view is dead at
    ``give`` time come here (never the reduced output, which gradient shards are views of).

    Activation swapping keeps its host buffers in :class:`hyper_adaptor.memory.SwapBufferPool`
    instead: pinned, owned until cleared and reused at their exact size, not a bounded cache of views."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            blocks = self.free.get((dtype, device), [])
            fitting = [i for i, b in enumerate(blocks) if b.numel() >= numel]
            if fitting:
                block = blocks.pop(min(fitting, key=lambda i: blocks[i].numel()))
                return block[:numel]
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            return
        block = tensor if tensor._base is None else tensor._base
        blocks = self.free.setdefault((block.dtype, block.device), [])
        if any(b.data_ptr() == block.data_ptr() for b in blocks):
            return
        blocks.append(block)
        blocks.sort(key=torch.Tensor.numel, reverse=True)
        del blocks[self.keep :]

    def reserved_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for blocks in self.free.values() for b in blocks)
