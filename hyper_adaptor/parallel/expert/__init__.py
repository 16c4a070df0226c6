"""Expert parallel: dropless token dispatch for mixture-of-experts layers (no megatron import here).

Primitives (every piece of the engine is built from these):

- ``_permute.py``: ``permute`` / ``unpermute`` (routed tokens sorted by expert and back, weighted by the
  router's probabilities), ``capacity`` / ``capacity_mask`` (token dropping) and padding;
- ``_comm.py``: ``exchange_counts`` (the token-count all-to-all), ``all_to_all`` / ``all_to_all_async``
  (uneven, differentiable), ``chunk_order`` / ``reorder`` (by source rank <-> by local expert).

The engine:

- ``_dispatcher.py``: ``AllToAllDispatcher`` — dropless (or capacity-bounded) dispatch and combine over
  an expert-parallel group, with expert tensor parallel over a second group and uneven placements;
- ``_experts.py``: ``GroupedExperts`` (the local experts' SwiGLU / GeLU FFNs through the grouped GEMM)
  and ``FeedForward`` (a dense FFN: the shared expert);
- ``moe.py``: ``MoE``, a plain-torch block (router, routed experts, optional shared expert), one
  process by default;
- ``style.py``: ``ExpertParallel`` / ``ExpertTensorParallel``, torch ``ParallelStyle``s that shard a
  ``MoE`` over a 1-D ("ep",) or 2-D ("ep", "tp") device mesh through ``parallelize_module``;
- ``_overlap.py``: the chunked overlapped forward (``overlapped_moe_forward``, ``moe_forward_overlapped``)
  and ``CommComputeOverlap`` (one micro-batch's forward beside another's backward);
- ``_replicas.py``: ``HotExpertReplicas`` (hot-expert replicas planned from measured token counts).
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
from hyper_adaptor.parallel.expert._dispatcher import AllToAllDispatcher
from hyper_adaptor.parallel.expert._experts import FeedForward, GroupedExperts
from hyper_adaptor.parallel.expert._overlap import (
    CommComputeOverlap,
    HookCoordinator,
    HookRole,
    OverlapStats,
    measure_exposed_comm,
    moe_forward_overlapped,
    overlapped_moe_forward,
)
from hyper_adaptor.parallel.expert._permute import (
    DROP_POLICIES,
    Permutation,
    capacity,
    capacity_mask,
    permute,
    unpermute,
)
from hyper_adaptor.parallel.expert._replicas import (
    HotExpertReplicas,
    ReplicaPlan,
    attach_replicas,
    plan_replicas,
    route_to_slots,
    skewed_load_report,
    zipf_bias,
)
from hyper_adaptor.parallel.expert.moe import MoE
from hyper_adaptor.parallel.expert.style import ExpertParallel, ExpertTensorParallel

__all__ = [
    "AllToAllDispatcher",
    "DROP_POLICIES",
    "PendingExchange",
    "Permutation",
    "all_to_all",
    "all_to_all_async",
    "capacity",
    "capacity_mask",
    "chunk_order",
    "exchange_counts",
    "experts_per_rank",
    "permute",
    "reorder",
    "send_splits",
    "unpermute",
    "ExpertParallel",
    "ExpertTensorParallel",
    "FeedForward",
    "GroupedExperts",
    "MoE",
    "HotExpertReplicas",
    "ReplicaPlan",
    "attach_replicas",
    "plan_replicas",
    "route_to_slots",
    "skewed_load_report",
    "zipf_bias",
    "CommComputeOverlap",
    "HookCoordinator",
    "HookRole",
    "OverlapStats",
    "measure_exposed_comm",
    "moe_forward_overlapped",
    "overlapped_moe_forward",
]

