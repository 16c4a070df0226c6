"""A small layer stack for the memory engine's tests (plain torch modules)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Mark(torch.autograd.Function):
    """Identity that appends ("compute", tag) to ``log`` when its backward runs: placed last in a layer,
    it marks the moment that layer's backward starts computing."""

    @staticmethod
    def forward(ctx, x, log, tag):
        ctx.log, ctx.tag = log, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("compute", ctx.tag))
        return grad, None, None


class Block(nn.Module):
    """Pre-norm attention + MLP, small enough for a unit test."""

    def __init__(self, hidden: int = 32, heads: int = 4, log=None, tag=None) -> None:
        super().__init__()
        self.heads, self.log, self.tag = heads, log, tag
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def attention(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (h // self.heads) ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.proj(torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h))

    def mlp(self, x):
        return self.fc2(torch.sin(F.gelu(self.fc1(self.ln2(x)))))

    def forward(self, x):
        x = x + self.attention(x)
        x = x + self.mlp(x)
        return Mark.apply(x, self.log, self.tag) if self.log is not None else x


def make_stack(layers: int = 4, hidden: int = 32, seed: int = 0, log=None) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(Block(hidden, log=log, tag=i) for i in range(layers))


def batch(seed: int = 1, b: int = 2, s: int = 16, hidden: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, hidden, generator=g)


def step(stack, x, between=None, before=None):
    """Forward + backward of the stack on ``x``; ``before()`` runs right before the forward (gradients
    cleared, input ready), ``between()`` after it. Returns the loss and every gradient (parameters and
    input)."""
    stack.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    if before is not None:
        before()
    h = x * 1.0  # a non-leaf input, as a layer's input is inside a model
    for layer in stack:
        h = layer(h)
    loss = h.float().square().mean()
    if between is not None:
        between()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in stack.parameters()] + [x.grad.clone()]
