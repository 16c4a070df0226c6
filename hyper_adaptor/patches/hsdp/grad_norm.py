"""Megatron's gradient norm for HSDP's DTensor gradients.

megatron-core's ``get_grad_norm_fp32`` sums the squares of local gradient shards and all-reduces
them over the data-parallel group it reads off a DTensor's mesh: right for FSDP2, where every
gradient is a ``Shard(0)`` DTensor on a 1-D mesh, but HSDP also keeps small parameters whole
(``Replicate`` gradients, which that sum would count once per rank) and uses a 2-D mesh for hybrid
sharding (where megatron's ``device_mesh.get_group()`` raises). The wrapper takes over when every
gradient is a DTensor: ``grad_sq_sum`` counts each element once, then the model-parallel reduction
is megatron's own. Anything else goes to megatron's function unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_adaptor.parallel.hsdp import grad_sq_sum


def hsdp_grad_norm(original):
    @functools.wraps(original)
    def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else list(grads_for_norm)
        if float(norm_type) != 2.0 or not grads or not all(isinstance(g, DTensor) for g in grads):
            return original(grads_for_norm, norm_type, grad_stats_parallel_group)
        total = grad_sq_sum(grads)
        if grad_stats_parallel_group is not None:
            dist.all_reduce(total, group=grad_stats_parallel_group)
        return float(total.sqrt())

    return get_grad_norm_fp32
