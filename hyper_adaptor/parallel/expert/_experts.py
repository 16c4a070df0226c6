"""Routed experts as grouped GEMMs: every local expert's FFN applied to its block of rows in one call
per projection.

One parameter per projection holds all local experts, [E_local, out, in] in ``F.linear`` layout, so a
style can shard experts by slicing dim 0 and expert tensor parallel by slicing the hidden (ffn)
dimension — dim 1 of the column-parallel ``w_gate`` / ``w_up``, dim 2 of the row-parallel ``w_down``.
SwiGLU keeps gate and up as two parameters rather than one fused [2F, H] tensor for the same reason: a
column shard of a fused tensor would take gate rows from one rank and up rows from another.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hyper_adaptor.ops.grouped_gemm import grouped_gemm

ACTIVATIONS = ("swiglu", "gelu")


def _ffn_check(hidden: int, ffn: int, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if hidden < 1 or ffn < 1:
        raise ValueError(f"hidden and ffn sizes must be >= 1, got hidden={hidden}, ffn={ffn}")


class GroupedExperts(nn.Module):
    """``num_experts`` FFNs (SwiGLU: ``w_down(silu(w_gate x) * w_up x)``; GeLU: ``w_down(gelu(w_up x))``),
    no biases. ``forward(x [M, H], tokens_per_expert)``: rows sorted by expert, ``tokens_per_expert[e]``
    of them for local expert e (what ``AllToAllDispatcher.dispatch`` returns).

    ``first_expert`` is the global id of local expert 0 and ``ffn`` the local width (a shard of the
    full width under expert tensor parallel); the styles set both when they shard.
    """

    def __init__(self, num_experts: int, hidden: int, ffn: int, activation: str = "swiglu", *,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        _ffn_check(hidden, ffn, activation)
        if num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {num_experts}")
        self.num_experts, self.hidden, self.ffn, self.activation = num_experts, hidden, ffn, activation
        self.first_expert = 0
        factory = dict(dtype=dtype, device=device)
        if activation == "swiglu":
            self.w_gate = nn.Parameter(torch.empty(num_experts, ffn, hidden, **factory))
        self.w_up = nn.Parameter(torch.empty(num_experts, ffn, hidden, **factory))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, ffn, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default bound, per expert (fan_in of each projection)
        for param in self.projections().values():
            bound = 1 / math.sqrt(param.shape[2])
            nn.init.uniform_(param, -bound, bound)

    def projections(self) -> dict[str, nn.Parameter]:
        """The expert weights by name; column-parallel ones first (``w_down`` is row-parallel)."""
        names = ("w_gate", "w_up", "w_down") if self.activation == "swiglu" else ("w_up", "w_down")
        return {name: getattr(self, name) for name in names}

    def forward(self, x: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        counts = [int(c) for c in tokens_per_expert]
        if len(counts) != self.num_experts:
            raise ValueError(f"GroupedExperts: {len(counts)} group sizes for {self.num_experts} local experts")
        if self.num_experts == 0:
            # a rank an uneven placement leaves without experts gets no rows; keep the graph connected
            # so that the backward exchanges still run on it
            return x * 0
        if self.activation == "swiglu":
            hidden = F.silu(grouped_gemm(x, self.w_gate, counts)) * grouped_gemm(x, self.w_up, counts)
        else:
            hidden = F.gelu(grouped_gemm(x, self.w_up, counts))
        return grouped_gemm(hidden, self.w_down, counts)

    def extra_repr(self) -> str:
        return (f"experts={self.first_expert}..{self.first_expert + self.num_experts - 1}, hidden={self.hidden}, "
                f"ffn={self.ffn}, activation={self.activation}")


class FeedForward(nn.Module):
    """One dense FFN of the same shape family (the shared expert): plain ``nn.Linear`` layers, replicated."""

    def __init__(self, hidden: int, ffn: int, activation: str = "swiglu", *, dtype: torch.dtype | None = None,
                 device=None):
        super().__init__()
        _ffn_check(hidden, ffn, activation)
        self.activation = activation
        factory = dict(bias=False, dtype=dtype, device=device)
        if activation == "swiglu":
            self.gate = nn.Linear(hidden, ffn, **factory)
        self.up = nn.Linear(hidden, ffn, **factory)
        self.down = nn.Linear(ffn, hidden, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))
