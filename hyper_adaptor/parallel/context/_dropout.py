"""Attention dropout under context parallel: one mask, whichever algorithm computes the attention.

With A = softmax(S) over ALL keys and a keep-mask M drawn with probability 1 - p, dropout gives
O = (A * M / (1 - p)) V. A block of keys j contributes (exp(S_j - lse_j) * M_j / (1 - p)) V_j with lse_j
from the unmasked scores, so ``merge_attention``'s weights are unchanged and the merged result is dropout
on the globally normalised probabilities; the block backward takes the same M_j (see
``hyper_adaptor.ops.attention_lse``).

The mask is never stored: M[b, h, i, j] is a hash of (a per-call base seed, batch b, GLOBAL query head h,
GLOBAL query position i, GLOBAL key position j), recomputed for a block in its forward and its backward.
Because it depends only on global coordinates, ring, all-gather, Ulysses and hybrid drop exactly the same
entries, and a single-process dense attention with ``Dropout.keep`` over the whole sequence is their exact
reference. A counter-based hash rather than a seeded ``torch.Generator`` per block: blocks are cut
differently by each algorithm (half chunks, gathered rows, head slices), and any cut of a hash is the
same cut of the one mask, with no per-block generator state.

The base seed is drawn per forward from the default generator of the tensors' device (so
``torch.manual_seed`` and megatron's RNG tracker, when the caller forks it, govern it); every rank holding
the same seed is only needed for comparing with a reference, since each (query, key) entry is computed
by exactly one rank, in its forward and its backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyper_adaptor.ops.attention_lse import attention_lse_backward, attention_with_lse

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # odd, below 2**31: the product of a 32-bit value with it stays inside int64
_BITS = 24  # resolution of the keep probability


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit values (held in int64) that spreads every input bit over the output."""
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    return x ^ (x >> 16)


def draw_seed(device) -> torch.Tensor:
    """A fresh base seed (int64 scalar on ``device``) from that device's default generator, no host sync."""
    return torch.randint(0, _M32, (), dtype=torch.int64, device=device)


def check_p(p, name: str = "dropout_p") -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"{name} (context-parallel attention dropout) must be a number in [0, 1), got {p!r}")
    return float(p)


@dataclass(frozen=True)
class Dropout:
    """Attention dropout ``p`` with base ``seed``; ``head_offset`` is the global index of the first query
    head the caller holds (Ulysses and hybrid hold a slice of the heads)."""

    p: float
    seed: torch.Tensor
    head_offset: int = 0

    def heads_from(self, offset: int) -> Dropout:
        return Dropout(self.p, self.seed, self.head_offset + offset)

    def keep(self, q_pos: torch.Tensor, k_pos: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
        """Bool keep-mask [batch, heads, len(q_pos), len(k_pos)] for these global positions."""
        device = q_pos.device
        x = self.seed.to(device=device, dtype=torch.int64).reshape(1, 1, 1, 1)
        b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
        h = torch.arange(self.head_offset, self.head_offset + heads, device=device).view(1, -1, 1, 1)
        for coordinate in (b, h, q_pos.view(1, 1, -1, 1), k_pos.view(1, 1, 1, -1)):
            x = _mix(x ^ (coordinate.to(torch.int64) & _M32))
        return (x >> (32 - _BITS)) >= round(self.p * (1 << _BITS))


def positions(rank: int, n: int, s_local: int, load_balanced: bool, device) -> torch.Tensor:
    """Global positions of the rows position ``rank`` of ``n`` holds (the layout of the package doc)."""
    if not load_balanced:
        return torch.arange(rank * s_local, (rank + 1) * s_local, device=device)
    c = s_local // 2
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c, device=device)])


def block_dropout(dropout: Dropout | None, q, q_pos, k_pos) -> dict:
    """The block kernels' dropout arguments for queries ``q`` at ``q_pos`` against keys at ``k_pos``."""
    if dropout is None:
        return {}
    return dict(dropout_p=dropout.p, keep=dropout.keep(q_pos, k_pos, q.shape[1], q.shape[2]))


class _DroppedAttention(torch.autograd.Function):
    """One block of attention with dropout (no merging): the mask regenerated in backward, not saved."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, causal, scale, backend, dropout):
        out, lse = attention_with_lse(q, k, v, causal=causal, scale=scale, backend=backend,
                                      **block_dropout(dropout, q, q_pos, k_pos))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos)
        ctx.options = dict(causal=causal, scale=scale, backend=backend)
        ctx.dropout = dropout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_pos, k_pos = ctx.saved_tensors
        grads = attention_lse_backward(dout, q, k, v, out, lse, **ctx.options,
                                       **block_dropout(ctx.dropout, q, q_pos, k_pos))
        return (*grads, None, None, None, None, None, None)


def dropped_attention(q, k, v, q_pos, k_pos, *, causal, scale, backend, dropout: Dropout):
    """q [sq, b, np, hn] at global rows ``q_pos`` over k, v [sk, b, ng, hn] at ``k_pos`` -> [sq, b, np, hn]."""
    return _DroppedAttention.apply(q, k, v, q_pos, k_pos, causal, scale, backend, dropout)
