"""Expert parallel: dropless token dispatch for mixture-of-experts layers (no megatron import here).

Primitives (every piece of the engine is built from these):

- ``_permute.py``: ``permute`` / ``unpermute`` (routed tokens sorted by expert and back, weighted by the
  router's probabilities), ``capacity`` / ``capacity_mask`` (token dropping) and padding;
- ``_comm.py``: ``exchange_counts`` (the token-count all-to-all), ``all_to_all`` / ``all_to_all_async``
  (uneven, differentiable), ``chunk_order`` / ``reorder`` (by source rank <-> by local expert).
"""

from __future__ import annotations

from hyper_adaptor.parallel.expert._comm import (
    PendingExchange,
    all_to_all,
    all_to_all_async,
    chunk_order,
    exchange_counts,
    experts_per_rank,
    reorder,
    send_splits,
)
from hyper_adaptor.parallel.expert._permute import (
    DROP_POLICIES,
    Permutation,
    capacity,
    capacity_mask,
    permute,
    unpermute,
)

__all__ = ["DROP_POLICIES", "PendingExchange", "Permutation", "all_to_all", "all_to_all_async", "capacity",
           "capacity_mask", "chunk_order", "exchange_counts", "experts_per_rank", "permute", "reorder", "send_splits",
           "unpermute"]

from hyper_adaptor.parallel.expert._overlap import (  # noqa: E402
    CommComputeOverlap,
    HookCoordinator,
    HookRole,
    OverlapStats,
    measure_exposed_comm,
    overlapped_moe_forward,
)

__all__ += ["CommComputeOverlap", "HookCoordinator", "HookRole", "OverlapStats", "measure_exposed_comm",
            "overlapped_moe_forward"]
