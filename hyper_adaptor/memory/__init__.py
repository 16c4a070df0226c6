"""Memory engines (no megatron import): activation swap with prefetch, checkpointing with recompute
policies (``MUST_SWAP`` included), and optimizer offload.

- ``SwapManager`` (``swap_manager.py``): saved activations per group moved to host on a copy stream,
  prefetched back one group ahead in backward, host buffers pooled across steps;
- ``swap``, ``swap_wrapper``, ``swap_tensor_wrapper``, ``checkpoint``, ``checkpoint_wrapper``,
  ``CheckpointPolicy`` (``api.py``): HyperParallel's API over torch's selective checkpointing and
  saved-tensor hooks;
- ``OffloadOptimizer`` (``optimizer_offload.py``): optimizer state and master weights on the host.

Streams, events and host buffers come from ``hyper_adaptor.platform``.
"""

from hyper_adaptor.memory._pool import SwapBufferPool
from hyper_adaptor.memory.api import (
                                      CheckpointPolicy,
                                      checkpoint,
                                      checkpoint_exclude_wrapper,
                                      checkpoint_wrapper,
                                      swap,
                                      swap_tensor_wrapper,
                                      swap_wrapper,
                                      unwrap,
)
from hyper_adaptor.memory.optimizer_offload import OffloadOptimizer
from hyper_adaptor.memory.swap_manager import (
                                      GroupState,
                                      SwapError,
                                      SwapGroup,
                                      SwapManager,
                                      default_swap_manager,
                                      set_default_swap_manager,
)

__all__ = ["CheckpointPolicy", "GroupState", "OffloadOptimizer", "SwapBufferPool", "SwapError", "SwapGroup",
           "SwapManager", "checkpoint", "checkpoint_exclude_wrapper", "checkpoint_wrapper", "default_swap_manager",
           "set_default_swap_manager", "swap", "swap_tensor_wrapper", "swap_wrapper", "unwrap"]
