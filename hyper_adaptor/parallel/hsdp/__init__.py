"""HSDP — hybrid sharded data parallel (ZeRO levels 1/2/3 over shard groups, replicas beyond them).

No megatron import here: ``hyper_adaptor.patches.hsdp`` adapts Megatron's DDP and optimizer set-up
to this engine. See docs/features/hsdp.md.
"""

from hyper_adaptor.parallel.hsdp._config import (
                                                 DEFAULT_BUCKET_KB,
                                                 CPUOffloadPolicy,
                                                 HSDPConfig,
                                                 MixedPrecisionPolicy,
                                                 OffloadPolicy,
)
from hyper_adaptor.parallel.hsdp._pool import HostBufferPool
from hyper_adaptor.parallel.hsdp._state import mark_stale
from hyper_adaptor.parallel.hsdp.api import (
                                                 HSDPModule,
                                                 clip_grad_norm_,
                                                 fully_shard,
                                                 grad_sq_sum,
                                                 hsdp,
                                                 hsdp_sync_stream,
)

__all__ = [
    "CPUOffloadPolicy", "DEFAULT_BUCKET_KB", "HSDPConfig", "HSDPModule", "HostBufferPool", "MixedPrecisionPolicy",
    "OffloadPolicy",
    "clip_grad_norm_", "fully_shard", "grad_sq_sum", "hsdp", "hsdp_sync_stream", "mark_stale",
]
