"""Hybrid (USP): Ulysses inside groups of U ranks, ring attention across the G = N / U groups.

Ulysses alone needs U to divide the heads; the ring alone pays N steps of small blocks. Hybrid uses
Ulysses as far as the heads allow and the ring for the rest (``groups.ulysses`` holds positions
g*U .. g*U+U-1, ``groups.ring`` the positions at the same place u in every Ulysses group).

Why the ring can run on the Ulysses output unchanged: the all-to-all inside Ulysses group g gathers its
members' rows, reordered as ``to_natural_order`` does for a group of U (first halves ascending, second
halves descending). Without load balance the members hold slices g*U .. g*U+U-1 of N, so the group now
holds contiguous slice g of G. With load balance member g*U+i holds chunks g*U+i and 2N-1-g*U-i (size c),
so the first halves form big chunk g (U*c rows) and the second halves, descending, big chunk 2G-1-g: the
load-balanced layout of a ring of G. Every rank of Ulysses group g then holds that same sequence shard
for its own head slice, and the ring group at place u joins the same head slice of every g.
"""

from __future__ import annotations

from hyper_adaptor.parallel.context._ring import ring_attention
from hyper_adaptor.parallel.context._ulysses import check_heads, heads_to_seq, repeat_kv_heads, seq_to_heads


def hybrid_attention(q, k, v, *, groups, causal: bool, load_balanced: bool, scale=None, backend=None,
                     stats=None, dropout=None):
    """q [s_local, b, np, hn], k/v [s_local, b, ng, hn] sharded over ``groups.cp`` -> [s_local, b, np, hn]."""
    ulysses = groups.ulysses
    check_heads(q, ulysses.size())
    k, v = repeat_kv_heads(k, v, ulysses.size())
    q, k, v = (seq_to_heads(t, ulysses, load_balanced) for t in (q, k, v))
    if dropout is not None:  # the ring's positions are global ones (above); the heads are slice ulysses.rank()
        dropout = dropout.heads_from(ulysses.rank() * q.shape[2])
    out = ring_attention(q, k, v, group=groups.ring, causal=causal, load_balanced=load_balanced,
                         scale=scale, backend=backend, stats=stats, dropout=dropout)
    return heads_to_seq(out, ulysses, load_balanced)
