"""Context parallel: attention over a sequence sharded across ranks (no megatron import here).

``context_parallel_attention(q, k, v, groups=..., algo=...)`` takes megatron's layout, q
``[s_local, b, np, hn]`` and k/v ``[s_local, b, ng, hn]`` (GQA: np a multiple of ng), sharded over the CP
group of N with position r = ``groups.cp.rank()``: load-balanced as megatron's ``get_batch_on_this_cp_rank``
(2N equal chunks, position r holds chunks r and 2N-1-r, in that order), otherwise the contiguous slice r;
causal means the lower triangle over global positions. Returns this rank's ``[s_local, b, np, hn]``:

- ``ulysses`` (``_ulysses.py``): all-to-all to head shards, whole-sequence attention, all-to-all back;
- ``ring`` (``_ring.py``): K/V blocks travel the ring, partial results merged by log-sum-exp;
- ``allgather`` (``_allgather.py``): K/V all-gathered, queries local;
- ``hybrid`` (``_hybrid.py``): Ulysses inside ``groups.ulysses``, ring across ``groups.ring``.

``build_cp_groups`` (``_groups.py``) makes the groups; ``ContextParallel`` (``style.py``) is the same engine
as a PyTorch ``ParallelStyle``.
"""

from __future__ import annotations

import torch

from hyper_adaptor.ops.attention import attention
from hyper_adaptor.parallel.context._allgather import allgather_attention
from hyper_adaptor.parallel.context._dropout import Dropout, check_p, draw_seed, dropped_attention
from hyper_adaptor.parallel.context._groups import ALGORITHMS, CPGroups, build_cp_groups
from hyper_adaptor.parallel.context._hybrid import hybrid_attention
from hyper_adaptor.parallel.context._ring import RingStats, check_qkv, ring_attention
from hyper_adaptor.parallel.context._ulysses import ulysses_attention
from hyper_adaptor.parallel.context.style import ContextParallel


def context_parallel_attention(q, k, v, *, groups: CPGroups, algo: str, causal: bool = True,
                               load_balanced: bool = True, scale=None, backend=None,
                               stats: RingStats | None = None, dropout_p: float = 0.0,
                               dropout_seed=None) -> torch.Tensor:
    """Attention of this rank's sequence shard over the whole CP group's sequence -> [s_local, b, np, hn].

    ``stats`` (a ``RingStats``) is filled by the ring-based algorithms (ring, hybrid) only. ``hybrid`` on
    groups built without hybrid subgroups (ulysses_degree N or 1) is plain Ulysses or ring. ``dropout_p``:
    attention dropout, its mask a function of ``dropout_seed`` (an int or int64 tensor; None: drawn from
    the default generator of q's device) and the global positions (``_dropout.py``), so every algorithm
    drops the same entries."""
    if algo not in ALGORITHMS:
        raise ValueError(f"algo must be one of {ALGORITHMS}, got {algo!r}")
    check_qkv("context parallel", q, k, v, load_balanced)
    options = dict(causal=causal, load_balanced=load_balanced, scale=scale, backend=backend)
    if check_p(dropout_p) > 0.0:
        seed = draw_seed(q.device) if dropout_seed is None else torch.as_tensor(dropout_seed, dtype=torch.int64)
        options["dropout"] = Dropout(dropout_p, seed)
    if groups.cp.size() == 1 and "dropout" in options:
        everywhere = torch.arange(q.shape[0], device=q.device)
        return dropped_attention(q, k, v, everywhere, everywhere, causal=causal, scale=scale, backend=backend,
                                 dropout=options["dropout"])
    if groups.cp.size() == 1:  # either layout of one rank is the natural order
        return attention(q, k, v, causal=causal, scale=scale, backend=backend).unflatten(2, q.shape[2:])
    if algo == "hybrid" and groups.ulysses is None:
        algo = "ulysses" if groups.ulysses_degree == groups.cp.size() else "ring"
    if algo == "ulysses":
        return ulysses_attention(q, k, v, group=groups.cp, **options)
    if algo == "allgather":
        return allgather_attention(q, k, v, group=groups.cp, **options)
    if algo == "ring":
        return ring_attention(q, k, v, group=groups.cp, stats=stats, **options)
    return hybrid_attention(q, k, v, groups=groups, stats=stats, **options)


__all__ = ["ALGORITHMS", "CPGroups", "ContextParallel", "Dropout", "RingStats", "build_cp_groups",
           "context_parallel_attention", "draw_seed", "ring_attention"]
