"""A Llama-style decoder in plain torch, small by default, for the library's composition tests and example.

RMSNorm, rotary position embedding (RoPE), SwiGLU feed-forward, grouped-query attention through
``scaled_dot_product_attention``, tied or untied output embedding, residual dropout.

What the parallel styles rely on:

- projections are separate ``nn.Linear`` modules (``wq``/``wk``/``wv``/``wo``, ``w1``/``w2``/``w3``) so that
  tensor parallel can shard them column- or row-wise; attention reshapes with ``-1`` heads, so it runs
  on whatever share of the heads its projections produce;
- the softmax attention is its own module (``core_attention``, ``forward(q, k, v)`` on ``[b, s, h, d]``)
  so that context parallel can replace it;
- the layers are a ``ModuleDict`` keyed by their index, and a pipeline stage (:func:`split_stage`) keeps
  only some of them plus, on the first / last stage, the embedding / the final norm and output: the
  parameter names are those of the whole model at every split, so a checkpoint saved at one pipeline
  size loads at another;
- RoPE positions are computed in attention from ``cp_rank`` (the position of this rank's contiguous
  sequence slice under context parallel, 0 otherwise), so no positions are passed through the stages.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 48
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig: {name} must be a positive int; got {value!r}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"LlamaConfig: dim {self.dim} must be n_heads {self.n_heads} times an even head size")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_kv_heads {self.n_kv_heads} must divide n_heads {self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LlamaConfig: dropout must be in [0, 1); got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on ``x`` [b, s, h, d] at ``positions`` [s] (the two halves of the head are the pairs)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [s, d/2]
    cos, sin = angles.cos()[None, :, None, :].to(x.dtype), angles.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CoreAttention(nn.Module):
    """Causal softmax attention of ``[b, s, h, d]`` q and k/v with fewer (GQA) heads -> ``[b, s, h, d]``."""

    def forward(self, q, k, v):
        repeat = q.shape[2] // k.shape[2]
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.core_attention = CoreAttention()
        self.cp_rank = 0  # set by context parallel: this rank's sequence slice starts at cp_rank * s

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        positions = torch.arange(s, device=x.device) + self.cp_rank * s
        q, k = rotate(q, positions, self.theta), rotate(k, positions, self.theta)
        return self.wo(self.core_attention(q, k, v).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class Llama(nn.Module):
    """``forward(tokens [b, s]) -> logits [b, s, vocab]``; a pipeline stage without the embedding takes
    the hidden states ``[b, s, dim]`` instead, one without the output returns them."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def build_llama(cfg: LlamaConfig | None = None, seed: int = 0) -> Llama:
    """The model with the weights ``seed`` gives (the same on every rank and in the reference)."""
    torch.manual_seed(seed)
    return Llama(cfg or LlamaConfig())


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def stage_layers(n_layers: int, stage_index: int, stage_num: int) -> list[int]:
    """The layers of stage ``stage_index`` of ``stage_num``: consecutive, the first stages one more
    where they do not divide evenly."""
    if not 0 <= stage_index < stage_num:
        raise ValueError(f"stage_index must be in [0, {stage_num}); got {stage_index!r}")
    if stage_num > n_layers:
        raise ValueError(f"pipeline stages ({stage_num}) must not outnumber the layers ({n_layers})")
    base, extra = divmod(n_layers, stage_num)
    start = stage_index * base + min(stage_index, extra)
    return list(range(start, start + base + (stage_index < extra)))


def split_stage(model: Llama, stage_index: int, stage_num: int) -> Llama:
    """A copy of ``model`` holding only stage ``stage_index``'s part (see the module doc)."""
    if stage_num > 1 and model.cfg.tie_embeddings:
        raise ValueError("pipeline parallel needs tie_embeddings=False: the embedding and the output would "
                         "sit on different stages")
    keep = {str(i) for i in stage_layers(model.cfg.n_layers, stage_index, stage_num)}
    stage = copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    if stage_index > 0:
        stage.tok_embeddings = None
    if stage_index < stage_num - 1:
        stage.norm = None
        stage.output = None
    return stage
