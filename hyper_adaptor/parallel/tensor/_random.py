"""Distributed RNG: ``manual_seed`` and a dropout whose mask on a sharded activation equals the
single-process mask.

What is exact: after ``manual_seed(seed)`` every rank's generator equals one process's. In a
replicated region (a plain or Replicate tensor, e.g. after RowwiseParallel) every tensor-parallel
rank draws the same numbers one process would, provided all of them consumed the RNG identically
before. On a *sharded* DTensor, torch's offset-based RNG tracker makes random ops draw the
unsharded tensor's numbers only on cuda-like devices; on CPU (and wherever it is unsupported) each
rank would draw the first numbers of the stream for its shard, and on CUDA the tracker's stream is
not the default generator's that one process draws from. So ``dropout`` here draws the FULL mask
for every DTensor (sharded or replicated) with the shared default generator, through ``F.dropout``
itself (on a tensor of ones: the kernel one process runs, so the same numbers on CPU and CUDA), and
keeps this rank's slice: exact everywhere, at the cost of one full-size mask per call.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

from hyper_adaptor.parallel.tensor import _torch_private


def manual_seed(seed: int, device_mesh=None) -> None:
    """Seed every generator of this process with ``seed`` (the same on every rank) and, where torch
    supports it on ``device_mesh``, its DTensor RNG tracker."""
    torch.manual_seed(seed)
    if device_mesh is not None:
        _torch_private.seed_rng_tracker(seed, device_mesh)


def dropout(x, p: float = 0.5, training: bool = True):
    """``F.dropout`` whose mask on a sharded DTensor equals the unsharded tensor's mask."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability p={p} must be within [0, 1]")
    if not isinstance(x, DTensor) or not training or p == 0.0 or \
            any(pl.is_partial() for pl in x.placements):
        return F.dropout(x, p, training)
    if p == 1.0:
        return x * 0.0
    local = x.to_local()
    # the mask scaled by 1/(1-p), drawn as one process's F.dropout draws it
    keep = F.dropout(torch.ones(x.shape, dtype=local.dtype, device=local.device), p, True)
    # every rank drew the same full mask: src_data_rank=None slices it locally, no communication
    local_keep = distribute_tensor(keep, x.device_mesh, x.placements, src_data_rank=None).to_local()
    out = local * local_keep
    return DTensor.from_local(out, x.device_mesh, x.placements, shape=x.shape, stride=x.stride())


class DistributedDropout(nn.Dropout):
    """``nn.Dropout`` using ``dropout`` above (exact masks on sequence- or otherwise-sharded DTensors)."""

    def forward(self, x):
        return dropout(x, self.p, self.training)
