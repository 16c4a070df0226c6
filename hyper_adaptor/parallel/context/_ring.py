"""Ring attention: the K/V blocks travel around the context-parallel group; every rank keeps its queries.

Each of the N ranks of ``group`` holds one shard of the sequence (load-balanced: chunks r and 2N-1-r of
2N equal chunks; otherwise the contiguous slice r). At step i, rank r attends with its queries to the K/V
block of rank j = r - i (mod N) while the next block is already on its way: one ``batch_isend_irecv``
(to r + 1, from r - 1) started before the compute and waited after it. Each step gives a partial output
and its log-sum-exp; ``merge_attention`` folds them in fp32 into the exact attention over everything
seen so far.

Causal masking decides, per step, which part of the block is computed at all (global positions):

    layout           block of rank j    computed                                  skipped
    any              j == r             all rows vs all rows, causal              -
    load-balanced    j < r              all 2c query rows vs kv chunk j           kv chunk 2N-1-j
    load-balanced    j > r              query chunk 2N-1-r vs all 2c kv rows      query chunk r
    contiguous       j < r              all rows vs all rows, no mask             -
    contiguous       j > r              nothing (every key is later)              the whole block

With load balance every step after the first is one half-sized unmasked block on every rank: the same
work everywhere, no masked half ever computed. Without causal masking every block is computed whole.

Backward is a second ring pass. The gradient of one block needs only the rows' FINAL output and lse
(``attention_lse_backward``), so blocks are differentiated one at a time in the same order: dq stays
here, while the fp32 dK/dV accumulators of a block travel around the ring with that block and, after
one last hop, arrive at the block's owner complete. K/V are sent before the compute (they need no
gradient); dK/dV after it, to the same neighbour in the same step.

Attention dropout (``dropout``, see ``_dropout.py``): each block's keep-mask is recomputed from the
block's global query and key positions in the forward and again in the backward, never stored.

Why not torch's ``_templated_ring_attention``: it is private, dispatches through DTensor
and SDPA in [b, h, s, d] with its own load balancer and rotation, and has no NPU kernel; adapting
megatron's layout, torch_npu's fused attention and the counters below to it would be longer than this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyper_adaptor.ops.attention_lse import attention_lse_backward, attention_with_lse, merge_attention
from hyper_adaptor.parallel.context._dropout import Dropout, block_dropout, positions

__all__ = ["RingStats", "ring_attention"]


@dataclass
class RingStats:
    """Counters a caller may pass in; the engine only adds to them. Blocks are counted in the forward
    (the backward differentiates the same blocks); bytes are sent by this rank in both passes."""

    blocks_full: int = 0  # block attentions computed without a mask
    blocks_causal: int = 0  # diagonal (causal) block attentions
    blocks_skipped: int = 0  # (q part, kv part) pairs fully masked, never computed
    bytes_sent: int = 0  # point-to-point bytes this rank sent (forward + backward)


def check_qkv(who: str, q, k, v, load_balanced: bool) -> None:
    """The layout every context-parallel algorithm takes (ValueError naming what does not fit)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)) or k.shape != v.shape:
        raise ValueError(f"{who}: expected q [s_local, b, np, hn] and k, v [s_local, b, ng, hn], got "
                         f"{[tuple(getattr(t, 'shape', ())) for t in (q, k, v)]}")
    if k.shape[0] != q.shape[0] or k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"{who}: k/v {tuple(k.shape)} do not fit q {tuple(q.shape)} (same local sequence, "
                         "batch and head size; query heads a multiple of key/value heads)")
    if load_balanced and q.shape[0] % 2:
        raise ValueError(f"{who}: load_balanced needs an even local sequence (chunks r and 2N-1-r of equal "
                         f"size), got s_local={q.shape[0]}")


def _block_rows(r: int, j: int, s_local: int, causal: bool, load_balanced: bool):
    """(query rows, key rows, causal) of rank r against the block of rank j (the table above), or None."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if j == r:
        return everything, everything, True
    if not load_balanced:
        return (everything, everything, False) if j < r else None
    half = s_local // 2
    if j < r:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


class _Ring:
    """This rank's place in the ring: sends go to the next position, receives come from the previous."""

    def __init__(self, group, stats: RingStats):
        self.group, self.stats = group, stats
        self.size, self.rank = group.size(), group.rank()
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors):
        """Send ``tensors`` (contiguous) to the next rank and receive as many like them from the
        previous one; returns (requests to wait on, the receive buffers)."""
        if self.size == 1:
            return [], list(tensors)
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        self.stats.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        return dist.batch_isend_irecv(ops), received


def _wait(requests):
    for request in requests:
        request.wait()


class _Positions:
    """The global positions of this rank's queries and of every block, for the dropout masks."""

    def __init__(self, ring: _Ring, q, load_balanced: bool, dropout: Dropout | None):
        self.ring, self.q, self.load_balanced, self.spec = ring, q, load_balanced, dropout

    def of(self, position: int) -> torch.Tensor:
        return positions(position, self.ring.size, self.q.shape[0], self.load_balanced, self.q.device)

    def dropout(self, j: int, q_rows, kv_rows) -> dict:
        if self.spec is None:
            return {}
        return block_dropout(self.spec, self.q[q_rows], self.of(self.ring.rank)[q_rows], self.of(j)[kv_rows])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, load_balanced, scale, backend, stats, dropout):
        ring = _Ring(group, stats)
        place = _Positions(ring, q, load_balanced, dropout)
        k, v = k.contiguous(), v.contiguous()  # sent as they are
        block = [k, v]
        out = lse = None
        for step in range(ring.size):
            j = (ring.rank - step) % ring.size
            more = step + 1 < ring.size
            if more:
                requests, incoming = ring.start(block)
            rows = _block_rows(ring.rank, j, q.shape[0], causal, load_balanced)
            if rows is None:
                stats.blocks_skipped += 1
            else:
                q_rows, kv_rows, diagonal = rows
                stats.blocks_causal += int(diagonal)
                stats.blocks_full += int(not diagonal)
                stats.blocks_skipped += int(causal and load_balanced and j != ring.rank)  # the masked half
                part, part_lse = attention_with_lse(q[q_rows], block[0][kv_rows], block[1][kv_rows],
                                                    causal=diagonal, scale=scale, backend=backend,
                                                    **place.dropout(j, q_rows, kv_rows))
                if out is None:  # step 0, the own block, covers every query row in every layout
                    acc = torch.promote_types(q.dtype, torch.float32)
                    out, lse = part.to(acc), part_lse.to(acc)
                else:
                    out[q_rows], lse[:, :, q_rows] = merge_attention(out[q_rows], lse[:, :, q_rows], part, part_lse)
            if more:
                _wait(requests)
                block = incoming
        out = out.to(q.dtype)
        # the rows' final out and lse are all the backward needs (no per-block partials kept)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.load_balanced, ctx.scale, ctx.backend, ctx.stats, ctx.dropout = (
            group, causal, load_balanced, scale, backend, stats, dropout)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group, ctx.stats)
        place = _Positions(ring, q, ctx.load_balanced, ctx.dropout)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        block = [k, v]
        block_grads = [torch.zeros(k.shape, dtype=acc, device=k.device) for _ in range(2)]  # travel with block
        for step in range(ring.size):
            j = (ring.rank - step) % ring.size
            more = step + 1 < ring.size
            requests, incoming = ring.start(block) if more else ([], None)
            rows = _block_rows(ring.rank, j, q.shape[0], ctx.causal, ctx.load_balanced)
            if rows is not None:
                q_rows, kv_rows, diagonal = rows
                dq_part, dk_part, dv_part = attention_lse_backward(
                    dout[q_rows], q[q_rows], block[0][kv_rows], block[1][kv_rows], out[q_rows],
                    lse[:, :, q_rows], causal=diagonal, scale=ctx.scale, backend=ctx.backend,
                    **place.dropout(j, q_rows, kv_rows))
                dq[q_rows] += dq_part
                block_grads[0][kv_rows] += dk_part
                block_grads[1][kv_rows] += dv_part
                del dq_part, dk_part, dv_part  # not alive beside the next block's (peak memory)
            # block j's dK/dV now hold this rank's share: on to the next rank with the block (after the
            # last step that is block j's owner, and what arrives here is this rank's own, complete)
            grad_requests, block_grads = ring.start(block_grads)
            _wait(requests + grad_requests)
            if more:
                block = incoming
        return (dq.to(q.dtype), block_grads[0].to(k.dtype), block_grads[1].to(v.dtype),
                None, None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, causal: bool,
                   load_balanced: bool, scale: float | None = None, backend: str | None = None,
                   stats: RingStats | None = None, dropout: Dropout | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence of ``group`` -> [s_local, b, np, hn].

    q [s_local, b, np, hn], k/v [s_local, b, ng, hn] (np a multiple of ng), sharded as the module doc
    says; ``backend`` picks the block kernels (``hyper_adaptor.ops.attention_lse``); ``stats`` is added to;
    ``dropout`` (``_dropout.Dropout``): attention dropout by global position."""
    check_qkv("ring_attention", q, k, v, load_balanced)
    group = dist.group.WORLD if group is None else group
    stats = RingStats() if stats is None else stats
    return _RingAttention.apply(q, k, v, group, causal, load_balanced, scale, backend, stats, dropout)
