"""All-gather context parallel: every rank gathers the whole K and V, its queries stay local.

The simplest CP (HyperParallel's ``ulysses_degree=1`` mode, TransformerEngine's ``allgather``): no head
constraint and no log-sum-exp merging, at the price of holding the whole K/V on every rank (for
backward too) and the causal imbalance of plain attention per chunk. It is the baseline the ring and
Ulysses engines are measured against.

Causal masking needs each local query chunk to see the keys up to its own end: every key before the
chunk, unmasked, and the chunk's own keys, causally. The two parts are computed as two blocks with their
log-sum-exp (``attention_with_lse``: a square causal block and an unmasked one, both served by the flash
kernels) and merged, as the ring merges its blocks — one call over keys[:end] with a bottom-right causal
mask would materialise a q x k mask and send SDPA to its math path, O(S^2) memory (seen in
bench/context_parallel.py before this was split).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyper_adaptor.ops.attention import attention
from hyper_adaptor.ops.attention_lse import attention_lse_backward, attention_with_lse, merge_attention
from hyper_adaptor.parallel.context._dropout import block_dropout, dropped_attention, positions
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


class _ChunkAttention(torch.autograd.Function):
    """One query chunk over the keys before it (unmasked; may be empty) and its own keys (causal); with
    ``dropout`` each part's mask is recomputed from global positions (the chunk starts at row ``start``)."""

    @staticmethod
    def _dropout(dropout, q, start):
        if dropout is None:
            return {}, {}
        own = torch.arange(start, start + q.shape[0], device=q.device)
        before = torch.arange(start, device=q.device)
        return block_dropout(dropout, q, own, own), block_dropout(dropout, q, own, before)

    @staticmethod
    def forward(ctx, q, k_before, v_before, k_own, v_own, scale, backend, dropout, start):
        own_drop, before_drop = _ChunkAttention._dropout(dropout, q, start)
        out, lse = attention_with_lse(q, k_own, v_own, causal=True, scale=scale, backend=backend, **own_drop)
        del own_drop
        if k_before.shape[0]:
            before, before_lse = attention_with_lse(q, k_before, v_before, causal=False, scale=scale, backend=backend,
                                                    **before_drop)
            out, lse = merge_attention(before, before_lse, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_before, v_before, k_own, v_own, out, lse)
        ctx.scale, ctx.backend, ctx.dropout, ctx.start = scale, backend, dropout, start
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_before, v_before, k_own, v_own, out, lse = ctx.saved_tensors
        options = dict(scale=ctx.scale, backend=ctx.backend)
        own_drop, before_drop = _ChunkAttention._dropout(ctx.dropout, q, ctx.start)
        dq, dk_own, dv_own = attention_lse_backward(dout, q, k_own, v_own, out, lse, causal=True, **options,
                                                    **own_drop)
        if k_before.shape[0]:
            dq_before, dk_before, dv_before = attention_lse_backward(dout, q, k_before, v_before, out, lse,
                                                                     causal=False, **options, **before_drop)
            dq = dq + dq_before
        else:
            dk_before, dv_before = torch.zeros_like(k_before), torch.zeros_like(v_before)
        return dq, dk_before, dv_before, dk_own, dv_own, None, None, None, None


def allgather_attention(q, k, v, *, group, causal: bool, load_balanced: bool, scale=None, backend=None,
                        dropout=None):
    """q [s_local, b, np, hn], k/v [s_local, b, ng, hn] sequence-sharded over ``group`` -> [s_local, b, np, hn]."""
    n, r, s = group.size(), group.rank(), q.shape[0]
    k_all = to_natural_order(_AllGather.apply(k, group), load_balanced)
    v_all = to_natural_order(_AllGather.apply(v, group), load_balanced)

    if not causal and dropout is not None:
        return dropped_attention(q, k_all, v_all, positions(r, n, s, load_balanced, q.device),
                                 torch.arange(k_all.shape[0], device=q.device), causal=False, scale=scale,
                                 backend=backend, dropout=dropout)
    if not causal:
        return attention(q, k_all, v_all, causal=False, scale=scale, backend=backend).unflatten(2, q.shape[2:])

    def attend(queries, start):
        """Queries of the chunk at global rows [start, start + len): keys before it, then its own."""
        end = start + queries.shape[0]
        return _ChunkAttention.apply(queries, k_all[:start], v_all[:start], k_all[start:end], v_all[start:end],
                                     scale, backend, dropout, start)

    if not load_balanced:
        return attend(q, r * s)
    # load balance: local chunks are global chunks r and 2N-1-r
    c = s // 2
    first, second = q.split(c)
    return torch.cat([attend(first, r * c), attend(second, (2 * n - 1 - r) * c)])
