"""Local permutation: routed tokens sorted by expert, and back, weighted by the router's probabilities.

A router gives ``routing_map`` [T, E] (bool: token t goes to expert e) and ``probs`` [T, E]. ``permute``
lays the routed copies out expert-major — every copy for expert 0 in token order, then expert 1, ... —
which is the row order a grouped GEMM wants; ``unpermute`` sums each token's expert outputs back into
its row, each multiplied by its probability. Both are an ``index_select`` / ``index_add`` pair, so their
backward passes are the other one (exact, deterministic on CPU). The weighted sum is an autograd function
of its own (``_SumRows``), for memory: see there.

Capacity (token dropping): ``capacity_mask`` keeps at most ``capacity`` copies per expert — those with
the highest probability (``policy="probs"``) or the earliest tokens (``"position"``) — and ``permute``
can pad each expert's rows to ``pad_to`` with zero rows that ``unpermute`` drops, so every expert sees the
same static row count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DROP_POLICIES = ("probs", "position")


@dataclass
class Permutation:
    """What ``unpermute`` needs to undo ``permute``: each permuted row's source token (``num_tokens``
    for a padding row), its probability, and the rows per expert."""

    rows: torch.Tensor               # [N] long
    probs: torch.Tensor | None       # [N], same dtype as the router's probs
    tokens_per_expert: list[int]     # E entries, sum N
    num_tokens: int                  # T
    padded: bool = False             # rows include padding rows (``pad_to``)


def capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """Rows per expert with capacity factor ``factor``: ceil(T * topk / E * factor)."""
    if factor <= 0:
        raise ValueError(f"capacity factor must be > 0, got {factor}")
    return math.ceil(num_tokens * topk / num_experts * factor)


def capacity_mask(routing_map: torch.Tensor, probs: torch.Tensor, cap: int, policy: str = "probs") -> torch.Tensor:
    """``routing_map`` with each expert's copies beyond ``cap`` dropped (bool [T, E])."""
    if policy not in DROP_POLICIES:
        raise ValueError(f"drop policy must be one of {DROP_POLICIES}, got {policy!r}")
    tokens = routing_map.shape[0]
    if cap >= tokens:
        return routing_map
    if policy == "probs":
        score = probs.masked_fill(~routing_map, float("-inf"))
    else:  # earlier tokens first
        order = torch.arange(tokens, 0, -1, device=routing_map.device, dtype=torch.float32)
        score = order[:, None].expand_as(routing_map).masked_fill(~routing_map, float("-inf"))
    # ties broken by token order (stable sort), so the choice is deterministic
    keep_rows = torch.sort(score, dim=0, descending=True, stable=True).indices[:cap]   # [cap, E]
    keep = torch.zeros_like(routing_map).scatter_(0, keep_rows, True)
    return routing_map & keep


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None,
            pad_to: int | None = None) -> tuple[torch.Tensor, Permutation]:
    """tokens [T, H] -> (rows [N, H] expert-major, Permutation). With ``pad_to`` every expert gets exactly
    that many rows (its copies, then zero rows); an expert with more copies is an error (drop them first
    with ``capacity_mask``)."""
    if tokens.dim() != 2 or routing_map.shape[0] != tokens.shape[0] or routing_map.dim() != 2:
        raise ValueError(f"permute: tokens [T, H] and routing_map [T, E] expected, got {tuple(tokens.shape)} "
                         f"and {tuple(routing_map.shape)}")
    if routing_map.dtype != torch.bool:
        raise ValueError(f"permute: routing_map must be bool, got {routing_map.dtype}")
    num_tokens, num_experts = routing_map.shape
    by_expert = routing_map.t()                                              # [E, T]
    counts = by_expert.sum(dim=1).tolist()
    token_ids = torch.arange(num_tokens, device=tokens.device).expand(num_experts, num_tokens)
    rows = token_ids.masked_select(by_expert)
    row_probs = None if probs is None else probs.t().masked_select(by_expert)
    source = tokens
    if pad_to is not None:
        if max(counts, default=0) > pad_to:
            raise ValueError(f"permute: an expert got {max(counts)} tokens, more than pad_to={pad_to}; drop the "
                             "excess with capacity_mask first")
        rows, row_probs = _pad(rows, row_probs, counts, pad_to, num_tokens)
        counts = [pad_to] * num_experts
        # padding rows read a zero row appended after the tokens
        source = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[1])])
    return source.index_select(0, rows), Permutation(rows, row_probs, [int(c) for c in counts], num_tokens,
                                                     padded=pad_to is not None)


def _pad(rows, row_probs, counts, pad_to, pad_row):
    pieces, prob_pieces, start = [], [], 0
    for count in counts:
        fill = pad_to - count
        pieces += [rows[start:start + count], rows.new_full((fill,), pad_row)]
        if row_probs is not None:
            prob_pieces += [row_probs[start:start + count], row_probs.new_zeros(fill)]
        start += count
    return torch.cat(pieces), (torch.cat(prob_pieces) if row_probs is not None else None)


def unpermute(expert_out: torch.Tensor, perm: Permutation, weighted: bool = True) -> torch.Tensor:
    """[N, H] expert outputs in ``permute``'s order -> [T, H]: each token's copies summed, each times
    its probability when ``weighted`` (padding rows are dropped)."""
    if expert_out.shape[0] != perm.rows.shape[0]:
        raise ValueError(f"unpermute: {expert_out.shape[0]} rows for a permutation of {perm.rows.shape[0]}")
    probs = perm.probs if weighted else None
    return _SumRows.apply(expert_out, probs, perm.rows, perm.num_tokens, perm.padded)


class _SumRows(torch.autograd.Function):
    """[N, H] rows, each times its probability (``probs`` [N] or None), summed into the [T, H] tokens
    ``index`` names (a padding row's index is T: dropped). Written by hand for memory: autograd's
    ``rows * probs`` then ``index_add`` keeps the weighted [N, H] copy (index_add's source) beside the rows,
    and its backward makes an [N, H] product for the probabilities' gradient; here the rows and ``index``
    are kept, that gradient is one batched dot product per row and the rows' gradient is weighted in
    place."""

    @staticmethod
    def forward(ctx, rows, probs, index, num_tokens, padded):
        ctx.save_for_backward(rows if probs is not None else None, probs, index)
        ctx.padded = padded
        weighted = rows if probs is None else rows * probs.to(rows.dtype)[:, None]
        out = rows.new_zeros(num_tokens + 1 if padded else num_tokens, rows.shape[1])
        return out.index_add_(0, index, weighted)[:num_tokens]

    @staticmethod
    def backward(ctx, grad):
        rows, probs, index = ctx.saved_tensors
        if ctx.padded:  # padding rows read a zero gradient row after the tokens'
            grad = torch.cat([grad, grad.new_zeros(1, grad.shape[1])])
        grad_rows = grad.index_select(0, index)
        grad_probs = None
        if probs is None:
            return grad_rows, None, None, None, None
        if ctx.needs_input_grad[1]:
            grad_probs = torch.bmm(grad_rows.unsqueeze(1), rows.unsqueeze(2)).view(-1).to(probs.dtype)
        return grad_rows.mul_(probs.to(grad_rows.dtype)[:, None]), grad_probs, None, None, None
