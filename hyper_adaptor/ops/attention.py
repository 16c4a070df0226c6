"""Core attention in megatron's layout: softmax(q k^T * scale, masked) v.

``attention(q, k, v, causal=..., mask=None, scale=None, dropout_p=0.0)``:

- q is [sq, b, np, hn], k and v are [sk, b, ng, hn] with np a multiple of ng (grouped-query attention:
  query head h reads key/value group h // (np // ng), as megatron's ``repeat_interleave`` does);
  v's head size may differ from q's and k's (multi-latent attention: [sk, b, ng, hv]);
- the result is [sq, b, np * hn] (np * hv), like megatron's ``DotProductAttention``;
- ``mask`` is a bool tensor broadcastable to [b, np|1, sq, sk] where True means "masked out"
  (megatron's convention);
- ``causal=True`` lets query i see keys j <= i + (sk - sq): aligned at the bottom-right, which for
  sq == sk is the usual lower triangle and for a single query (sq == 1, decoding) sees every key, as
  megatron does. A causal call may also carry a mask; both apply;
- ``scale`` defaults to 1/sqrt(hn); ``dropout_p`` drops attention probabilities (the caller passes 0
  outside training). Dropout draws from torch's default generator of the tensors' device, so the
  backends' random streams differ: same seed, same backend -> same result; across backends the
  dropped positions differ (only the statistics agree).

Backends:

- eager: scores in the input dtype, softmax in fp32 with masked scores set to -10000 (megatron's
  ``attention_mask_func``), probabilities cast back, dropout, then probs @ v. It materialises
  b*np*sq*sk probabilities. A row whose every key is masked gets uniform weights (megatron's result).
- fast: ``torch.nn.functional.scaled_dot_product_attention``. A plain causal call with sq == sk passes
  ``is_causal=True`` and no mask tensor, so PyTorch's flash kernel (CPU and CUDA) keeps memory O(s);
  GQA goes through ``enable_gqa=True`` without copying k/v. (With dropout_p > 0 PyTorch may pick
  its math kernel, which does hold the s x s probabilities; the O(s) claim is for dropout 0.) Other
  masks go in as SDPA bool masks (True = attend there). A row whose every key is masked gives zeros
  here (PyTorch's choice), not megatron's uniform weights; real padding rows are ignored by the loss
  either way.
- npu: ``torch_npu.npu_fusion_attention`` with input_layout "SBH" (q/k/v flattened to [s, b, heads*hn],
  GQA native), ``head_num=np``, ``scale``, ``keep_prob=1 - dropout_p`` and ``atten_mask`` with True =
  masked. Causal uses the documented compressed 2048x2048 upper-triangle mask with sparse_mode 2
  (top-left causal) when sq == sk, 3 (bottom-right causal) otherwise; a causal call that also carries
  a mask sends the combined mask with sparse_mode 0. Served for fp16/bf16 and head dims that are
  multiples of 16 up to 512 (the documented limits); anything else falls back.

The blocks of ring attention, which return the output with its log-sum-exp and take the gradient from a
given output and lse, are the other op: :mod:`hyper_adaptor.ops.attention_lse`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hyper_adaptor.ops.backend import Impl, Op, need_npu_tensor, npu_module

__all__ = ["attention", "attention_op", "causal_mask"]

MASKED_SCORE = -10000.0  # what megatron writes into masked scores before its softmax
NPU_COMPRESSED_MASK = 2048  # side of the compressed causal mask npu_fusion_attention's sparse modes take


def causal_mask(sq: int, sk: int, device=None) -> torch.Tensor:
    """[sq, sk] bool, True where query i must not see key j (bottom-right aligned)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)


def _check(q, k, v, mask):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"attention: expected q [sq, b, np, hn], k [sk, b, ng, hn] and v [sk, b, ng, hv]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: k/v {tuple(k.shape)} do not fit q {tuple(q.shape)} "
                         "(same batch and head dim, query heads a multiple of key/value groups)")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"attention: mask must be bool (True = masked out), got {mask.dtype}")


def _full_mask(sq, sk, causal, mask, device):
    """The one bool mask (True = masked) that says everything, or None when nothing is masked."""
    if causal and sq > 1:
        tri = causal_mask(sq, sk, device)
        return tri if mask is None else (mask | tri)
    return mask


def _heads_first(x):  # [s, b, h, d] -> [b, h, s, d]
    return x.permute(1, 2, 0, 3)


def _merge_heads(out):  # [b, np, sq, hn] -> [sq, b, np * hn]
    b, n, s, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


# ----------------------------------------------------------------------------------------- eager
def _eager(q, k, v, *, causal, mask=None, scale=None, dropout_p=0.0):
    _check(q, k, v, mask)
    sq, sk, groups = q.shape[0], k.shape[0], q.shape[2] // k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh, kh, vh = _heads_first(q), _heads_first(k), _heads_first(v)
    if groups > 1:
        kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    scores = scores.float()
    full = _full_mask(sq, sk, causal, mask, q.device)
    if full is not None:
        scores = scores.masked_fill(full, MASKED_SCORE)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return _merge_heads(torch.matmul(probs, vh))


# ------------------------------------------------------------------------------------------ fast
def _fast(q, k, v, *, causal, mask=None, scale=None, dropout_p=0.0):
    _check(q, k, v, mask)
    sq, sk, groups = q.shape[0], k.shape[0], q.shape[2] // k.shape[2]
    plain_causal = causal and mask is None and sq == sk and sq > 1
    full = None if plain_causal else _full_mask(sq, sk, causal, mask, q.device)
    out = F.scaled_dot_product_attention(
        _heads_first(q), _heads_first(k), _heads_first(v),
        attn_mask=None if full is None else ~full,  # SDPA: True = take part
        dropout_p=dropout_p, is_causal=plain_causal, scale=scale, enable_gqa=groups > 1,
    )
    return _merge_heads(out)


def _fast_supports(q, k, v, *, causal, mask=None, scale=None, dropout_p=0.0):
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        return f"mixed or non-float dtypes {q.dtype}/{k.dtype}/{v.dtype}"
    return None


# ------------------------------------------------------------------------------------------- npu
def _npu(q, k, v, *, causal, mask=None, scale=None, dropout_p=0.0):
    sq, b, n, d = q.shape
    sk, ng = k.shape[0], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    sparse_mode, atten_mask = 0, mask
    if causal and sq > 1:
        if mask is None:
            side = NPU_COMPRESSED_MASK
            atten_mask = causal_mask(side, side, q.device)
            sparse_mode = 2 if sq == sk else 3
        else:
            atten_mask = _full_mask(sq, sk, True, mask, q.device)
    if atten_mask is not None and sparse_mode == 0:
        while atten_mask.dim() < 4:
            atten_mask = atten_mask.unsqueeze(0)
        heads = n if atten_mask.shape[1] != 1 else 1
        atten_mask = atten_mask.expand(b, heads, sq, sk).contiguous()
    out = npu_module().npu_fusion_attention(
        q.reshape(sq, b, n * d), k.reshape(sk, b, ng * d), v.reshape(sk, b, ng * d),
        n, "SBH", atten_mask=atten_mask, scale=scale, keep_prob=1.0 - dropout_p,
        sparse_mode=sparse_mode,
    )[0]
    return out.reshape(sq, b, n * d)


def _npu_supports(q, k, v, *, causal, mask=None, scale=None, dropout_p=0.0):
    reason = need_npu_tensor(q, k, v, mask)
    if reason:
        return reason
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return f"dtype {q.dtype} (npu_fusion_attention is served for fp16/bf16 here)"
    if q.shape[-1] % 16 or q.shape[-1] > 512:
        return f"head dim {q.shape[-1]} (documented: a multiple of 16, at most 512)"
    if v.shape[-1] != q.shape[-1]:
        return f"value head dim {v.shape[-1]} != query/key head dim {q.shape[-1]} (served here only when equal)"
    if q.shape[2] > 256:
        return f"{q.shape[2]} query heads (documented: at most 256)"
    return None


attention_op = Op(
    "attention",
    npu=Impl(_npu, _npu_supports),
    fast=Impl(_fast, _fast_supports),
    eager=Impl(_eager),
)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              mask: torch.Tensor | None = None, scale: float | None = None, dropout_p: float = 0.0,
              backend: str | None = None) -> torch.Tensor:
    """Attention of q [sq, b, np, hn] over k, v [sk, b, ng, hn] -> [sq, b, np * hn]; see the module doc."""
    return attention_op(q, k, v, causal=causal, mask=mask, scale=scale, dropout_p=dropout_p,
                        backend=backend)
