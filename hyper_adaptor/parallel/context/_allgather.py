"""All-gather context parallel: every rank gathers the whole K and V, its queries stay local.

The simplest CP (HyperParallel's ``ulysses_degree=1`` mode, TransformerEngine's ``allgather``): no head
constraint and no log-sum-exp merging, at the price of holding the whole K/V on every rank (for
backward too) and the causal imbalance of plain attention per chunk. It is the baseline the ring and
Ulysses engines are measured against.

Causal masking needs each local query chunk to see the keys up to its own end. ``attention`` aligns
its causal mask at the bottom-right (query i of sq sees keys j <= i + sk - sq), so calling it with the
chunk's queries and keys[:end_of_chunk] is exactly the global lower triangle for that chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyper_adaptor.ops.attention import attention
from hyper_adaptor.parallel.context._ulysses import to_natural_order


class _AllGather(torch.autograd.Function):
    """[s_local, ...] -> [N, s_local, ...] (piece i = position i's tensor).

    Every position's rows were used by every rank, so their gradient is the sum of all ranks' gradient
    pieces for them: a reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        gathered = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)
        return gathered.unflatten(0, (group.size(), -1))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.flatten(0, 1).contiguous()
        mine = grad.new_empty((grad.shape[0] // ctx.group.size(), *grad.shape[1:]))
        dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
        return mine, None


def allgather_attention(q, k, v, *, group, causal: bool, load_balanced: bool, scale=None, backend=None):
    """q [s_local, b, np, hn], k/v [s_local, b, ng, hn] sequence-sharded over ``group`` -> [s_local, b, np, hn]."""
    n, r, s = group.size(), group.rank(), q.shape[0]
    k_all = to_natural_order(_AllGather.apply(k, group), load_balanced)
    v_all = to_natural_order(_AllGather.apply(v, group), load_balanced)

    def attend(queries, end):
        out = attention(queries, k_all[:end], v_all[:end], causal=causal, scale=scale, backend=backend)
        return out.unflatten(2, q.shape[2:])

    if not causal:
        return attend(q, n * s)
    if not load_balanced:
        return attend(q, (r + 1) * s)
    # load balance: local chunks are global chunks r and 2N-1-r; each sees the keys up to its end
    c = s // 2
    first, second = q.split(c)
    return torch.cat([attend(first, (r + 1) * c), attend(second, (2 * n - r) * c)])
