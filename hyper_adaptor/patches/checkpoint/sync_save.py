"""A synchronous torch_dist save keeps its write results in the process that wrote them.

megatron-core's torch_dist writer (``FileSystemWriterAsync``, used for synchronous saves too) hands the
write results of a rank's writer threads back through ``get_write_results_queue()``, a queue served by a
``multiprocessing`` Manager started under the *spawn* method at the rank's first save. A spawned process
imports the training script again as ``__mp_main__``: torch, megatron (and this adaptor, whose notice it
prints a second time) load once more in one extra process per rank, seconds of CPU and hundreds of MB of
host memory each, which stay until the run ends. That queue only has to cross a process boundary when the
save runs in another process (``--async-save``); a synchronous save (``strategy.save``) writes from the
training process's own threads and reads the results back in the same process.

So inside a synchronous save the writer gets an in-process ``queue.Queue`` (the same put / get_nowait the
writer uses); an asynchronous save gets megatron's queue, unchanged. Measured on the 2-core CI machine: a
2-rank examples/pretrain_gpt.py run with one save, 21.0 s -> 12.4 s wall (tests/e2e/test_checkpoint_layouts.py
checks that a saving run starts no process of its own).
"""

from __future__ import annotations

import functools
import queue
import threading

from hyper_adaptor.patch_manager import Patch

FEATURE = "checkpoint"
_inside = threading.local()


def patches(args) -> list:
    if getattr(args, "async_save", False):
        return []
    return [
        Patch("megatron.core.dist_checkpointing.strategies.torch.TorchDistSaveShardedStrategy.save",
              _marking_sync_save, kind="wrap", feature=FEATURE),
        Patch("megatron.core.dist_checkpointing.strategies.filesystem_async.get_write_results_queue",
              _in_process_queue, kind="wrap", feature=FEATURE),
    ]


def _marking_sync_save(save):
    @functools.wraps(save)
    def sync_save(*args, **kwargs):
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return save(*args, **kwargs)
        finally:
            _inside.depth -= 1
    return sync_save


def _in_process_queue(get_write_results_queue):
    @functools.wraps(get_write_results_queue)
    def write_results_queue(*args, **kwargs):
        if getattr(_inside, "depth", 0):
            return queue.Queue()
        return get_write_results_queue(*args, **kwargs)
    return write_results_queue
