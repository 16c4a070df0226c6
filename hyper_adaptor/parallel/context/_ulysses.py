"""Ulysses: trade the sequence shard for a head shard, attend over the whole sequence, trade back.

Each of the N ranks holds s_local rows of every head. One all-to-all sends head slice j of those rows to
position j, so afterwards every rank holds the whole sequence for np/N heads; softmax attention never
mixes heads, so each rank runs plain (causal) attention on its heads, and a second all-to-all puts the
rows back where they came from. Communication per rank: q, k, v and out, each (N-1)/N of its local
size, independent of the ring length - but N must divide the query heads.

The rows arrive ordered by the position that sent them. With load balance (megatron's
``get_batch_on_this_cp_rank`` layout: position i holds chunks i and 2N-1-i of 2N) that is not the
natural order, so the pieces are reordered before attention and back after; ``to_natural_order`` /
``from_natural_order`` do that and are shared with the all-gather and hybrid engines.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hyper_adaptor.ops.attention import attention
from hyper_adaptor.parallel.context._dropout import dropped_attention


# ----------------------------------------------------------------------------------- sequence order
def to_natural_order(pieces: torch.Tensor, load_balanced: bool) -> torch.Tensor:
    """[N, s_local, ...] with piece i = the rows position i holds -> [N * s_local, ...] in sequence order.

    Load-balanced: the first halves are chunks 0..N-1 (ascending positions), the second halves are
    chunks N..2N-1, held by positions N-1..0 (descending)."""
    if not load_balanced:
        return pieces.flatten(0, 1)
    halves = pieces.unflatten(1, (2, -1))                                    # [N, 2, c, ...]
    return torch.cat([halves[:, 0], halves[:, 1].flip(0)]).flatten(0, 1)  # [2N chunks, c, ...] -> rows


def from_natural_order(rows: torch.Tensor, n: int, load_balanced: bool) -> torch.Tensor:
    """The inverse: [N * s_local, ...] in sequence order -> [N, s_local, ...], piece i for position i."""
    if not load_balanced:
        return rows.unflatten(0, (n, -1))
    chunks = rows.unflatten(0, (2 * n, -1))                                  # [2N, c, ...]
    return torch.stack([chunks[:n], chunks[n:].flip(0)], dim=1).flatten(1, 2)


# -------------------------------------------------------------------------------------- all-to-all
def _exchange(pieces: torch.Tensor, group) -> torch.Tensor:
    pieces = pieces.contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces, group=group)
    return received


class _AllToAll(torch.autograd.Function):
    """[N, ...]: piece j goes to position j; the result's piece i came from position i.

    The exchange is its own adjoint (out_m[i] = in_i[m], so d in_i[m] = d out_m[i]): backward sends the
    gradient pieces back by the same exchange."""

    @staticmethod
    def forward(ctx, pieces, group):
        ctx.group = group
        return _exchange(pieces, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, group, load_balanced: bool) -> torch.Tensor:
    """[s_local, b, h, d] sequence-sharded -> [N * s_local, b, h / N, d]: all rows, head slice ``group.rank()``."""
    n = group.size()
    s, b, h, d = x.shape
    pieces = x.reshape(s, b, n, h // n, d).permute(2, 0, 1, 3, 4)  # piece j = head slice j
    return to_natural_order(_AllToAll.apply(pieces, group), load_balanced)


def heads_to_seq(x: torch.Tensor, group, load_balanced: bool) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: [N * s_local, b, h / N, d] -> [s_local, b, h, d]."""
    pieces = from_natural_order(x, group.size(), load_balanced)   # piece i = position i's rows
    received = _AllToAll.apply(pieces, group)                    # piece j = head slice j of my rows
    return received.permute(1, 2, 0, 3, 4).flatten(2, 3)


# ------------------------------------------------------------------------------------- GQA and heads
def check_heads(q: torch.Tensor, degree: int) -> None:
    if q.shape[2] % degree:
        raise ValueError(f"Ulysses: the query heads ({q.shape[2]}) must be divisible by the Ulysses "
                         f"degree ({degree})")


def repeat_kv_heads(k: torch.Tensor, v: torch.Tensor, degree: int):
    """Repeat each key/value head just enough for the degree to divide them.

    With fewer kv heads than the degree (or a count it does not divide), head slices cannot be cut.
    Repeating every kv head rep = N / gcd(ng, N) times (repeat_interleave, as megatron expands GQA) is
    the smallest repeat making ng * rep divisible by N, and keeps query head h on its kv head: N divides
    np = ng * (np / ng), so rep divides the group size np / ng, the new group size is (np / ng) / rep and
    h // ((np / ng) / rep) // rep = h // (np / ng). The repeat's backward sums the copies' gradients."""
    rep = degree // math.gcd(k.shape[2], degree)
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)


# ----------------------------------------------------------------------------------------- the engine
def ulysses_attention(q, k, v, *, group, causal: bool, load_balanced: bool, scale=None, backend=None,
                      dropout=None):
    """q [s_local, b, np, hn], k/v [s_local, b, ng, hn] sequence-sharded over ``group`` -> [s_local, b, np, hn]."""
    n = group.size()
    check_heads(q, n)
    k, v = repeat_kv_heads(k, v, n)
    # three exchanges rather than one fused q|k|v buffer: the same bytes, two more latencies, no packing code
    q, k, v = (seq_to_heads(t, group, load_balanced) for t in (q, k, v))
    if dropout is not None:  # this rank holds query heads slice group.rank() of the whole sequence
        everywhere = torch.arange(q.shape[0], device=q.device)
        out = dropped_attention(q, k, v, everywhere, everywhere, causal=causal, scale=scale, backend=backend,
                                dropout=dropout.heads_from(group.rank() * q.shape[2]))
        return heads_to_seq(out, group, load_balanced)
    out = attention(q, k, v, causal=causal, scale=scale, backend=backend)  # [S, b, np/N * hn]
    return heads_to_seq(out.unflatten(2, q.shape[2:]), group, load_balanced)
