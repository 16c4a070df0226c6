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
  its math kernel, which does hold the s x s probabilities; the O(s) claim is for dropout 0.) Other masks go in as SDPA bool masks
  (True = attend there). A row whose every key is masked gives zeros here (PyTorch's choice), not
  megatron's uniform weights; real padding rows are ignored by the loss either way.
- npu: ``torch_npu.npu_fusion_attention`` with input_layout "SBH" (q/k/v flattened to [s, b, heads*hn],
  GQA native), ``head_num=np``, ``scale``, ``keep_prob=1 - dropout_p`` and ``atten_mask`` with True =
  masked. Causal uses the documented compressed 2048x2048 upper-triangle mask with sparse_mode 2
  (top-left causal) when sq == sk, 3 (bottom-right causal) otherwise; a causal call that also carries
  a mask sends the combined mask with sparse_mode 0. Served for fp16/bf16 and head dims that are
  multiples of 16 up to 512 (the documented limits); anything else falls back.

``attention_with_lse`` / ``attention_lse_backward`` (the blocks of ring attention, at the end of the
file) return the output with its log-sum-exp and take the gradient from a given output and lse; their
backends are described there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hyper_adaptor.ops.backend import Impl, Op, need_npu_tensor, npu_module

__all__ = ["attention", "attention_op", "attention_with_lse", "attention_lse_backward", "causal_mask",
           "merge_attention"]

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


# =============================================================================== with log-sum-exp
# The blocks of ring attention (hyper_adaptor/parallel/context/_ring.py). A ring sees one key/value block
# at a time; with s = q k^T * scale and each row's log-sum-exp lse = log(sum_j exp(s_j)), partial results
# over disjoint key sets combine exactly (``merge_attention``):
#     lse = logaddexp(lse_1, lse_2),   out = exp(lse_1 - lse) * out_1 + exp(lse_2 - lse) * out_2.
# A block's backward needs only the row's FINAL out and lse, not the block's partial ones:
# P = exp(s - lse) is the block's slice of the full softmax, so with D = rowsum(dout * out)
#     dv = P^T dout,   dS = P * (dout v^T - D),   dq = dS k * scale,   dk = dS^T q * scale.
#
# Layouts: q [sq, b, np, hn], k/v [sk, b, ng, hn] -> out [sq, b, np, hn] in q's dtype, lse [b, np, sq]
# float32 (float64 for float64 inputs). causal=True only for a diagonal block (sq == sk, the lower
# triangle): a ring never needs an offset causal block, and refusing one keeps the kernels' different
# alignments (PyTorch's top-left, megatron's bottom-right) out of the question.
#
# Backends:
# - eager: the formulas above with plain matmuls in fp32 (the reference); kv heads repeated for GQA and
#   their gradients summed back over the group.
# - fast: PyTorch's private kernels that return the lse (reached only from ``_kernel_forward`` /
#   ``_kernel_backward``). CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which
#   serve GQA without copying (query head h reads kv head h // (np // ng)) and take any out/lse. CUDA:
#   ``_scaled_dot_product_efficient_attention`` and its backward, with kv heads repeated (the kernel wants
#   as many kv heads as query heads) and the lse it pads along the queries to a multiple of 32 cut off
#   (and padded back for the backward). Untested here: this machine has no GPU.
# - npu: ``npu_fusion_attention`` (SBH, GQA native) returns softmax_max and softmax_sum, documented as
#   fp32 [b, np, sq, 8] with 8 equal lanes: lse = max + log(sum). ``npu_fusion_attention_grad`` rebuilds
#   P = exp(s - softmax_max) / softmax_sum, so softmax_max = the final lse and softmax_sum = 1 give the
#   block's slice of the final softmax. fp16/bf16, head dim a multiple of 16 up to 512, as ``attention``.
#   Written against torch_npu's documented API; untested here (no torch_npu).
def _lse_dtype(q):
    return torch.promote_types(q.dtype, torch.float32)


def _scale_of(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _seq_first(x):  # [b, h, s, d] -> [s, b, h, d]
    return x.permute(2, 0, 1, 3)


def _sum_groups(grad, ng):  # [b, np, s, d] gradients of repeated kv heads -> [b, ng, s, d]
    b, n, s, d = grad.shape
    return grad.reshape(b, ng, n // ng, s, d).sum(2)


def _check_block(name, q, k, v, causal):
    _check(q, k, v, None)
    if causal and q.shape[0] != k.shape[0]:
        raise ValueError(f"{name}: causal=True is for diagonal blocks (sq == sk); got sq={q.shape[0]}, "
                         f"sk={k.shape[0]}")


# ----------------------------------------------------------------------------------------- eager
def _eager_scores(q, k, causal, scale):
    """(q, k with repeated heads, scores [b, np, sq, sk] with -inf above the diagonal), in fp32."""
    dt, groups = _lse_dtype(q), q.shape[2] // k.shape[2]
    qh = _heads_first(q).to(dt)
    kh = _heads_first(k).to(dt).repeat_interleave(groups, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(causal_mask(q.shape[0], k.shape[0], q.device), float("-inf"))
    return qh, kh, scores


def _eager_lse(q, k, v, *, causal, scale=None):
    _, _, scores = _eager_scores(q, k, causal, _scale_of(q, scale))
    lse = torch.logsumexp(scores, dim=-1)
    vh = _heads_first(v).to(lse.dtype).repeat_interleave(q.shape[2] // k.shape[2], dim=1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), vh)
    return _seq_first(out).to(q.dtype), lse


def _eager_lse_backward(dout, q, k, v, out, lse, *, causal, scale=None):
    scale = _scale_of(q, scale)
    qh, kh, scores = _eager_scores(q, k, causal, scale)
    dt, ng = scores.dtype, k.shape[2]
    probs = torch.exp(scores - lse.to(dt).unsqueeze(-1))
    vh = _heads_first(v).to(dt).repeat_interleave(q.shape[2] // ng, dim=1)
    do, o = _heads_first(dout).to(dt), _heads_first(out).to(dt)
    dv = torch.matmul(probs.transpose(-1, -2), do)
    ds = probs * (torch.matmul(do, vh.transpose(-1, -2)) - (do * o).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, kh)
    dk = torch.matmul(ds.transpose(-1, -2), qh)
    return (_seq_first(dq).to(q.dtype), _seq_first(_sum_groups(dk, ng)).to(k.dtype),
            _seq_first(_sum_groups(dv, ng)).to(v.dtype))


# ------------------------------------------------------------------------------------------ fast
# PyTorch's private SDPA kernels: private API, pinned to torch 2.13. These two functions are the only
# place that names them; tests/unit/ops/test_attention_lse.py checks what is relied on (the CPU kernel's
# GQA head mapping and lse layout, its backward from an externally merged out/lse).
_CUDA_LSE_ALIGN = 32  # the CUDA efficient kernel pads lse along the queries to a multiple of this


def _kernel_forward(qh, kh, vh, causal, scale):
    aten = torch.ops.aten
    if qh.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, causal, scale=scale)
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(qh, kh, vh, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : qh.shape[2]]


def _kernel_backward(doh, qh, kh, vh, oh, lse, causal, scale):
    aten = torch.ops.aten
    if qh.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            doh, qh, kh, vh, oh, lse, 0.0, causal, scale=scale)
    lse = F.pad(lse, (0, -lse.shape[-1] % _CUDA_LSE_ALIGN)).contiguous()
    no_rng = torch.empty((), dtype=torch.int64)  # philox seed and offset: unused without dropout
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        doh, qh, kh, vh, None, oh, lse, no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _kernel_kv(q, k, v):
    """k, v heads first, repeated to q's heads where the kernel cannot serve GQA itself (CUDA)."""
    kh, vh, groups = _heads_first(k), _heads_first(v), q.shape[2] // k.shape[2]
    if q.device.type != "cpu" and groups > 1:
        kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
    return kh, vh


def _fast_lse(q, k, v, *, causal, scale=None):
    kh, vh = _kernel_kv(q, k, v)
    out, lse = _kernel_forward(_heads_first(q), kh, vh, causal, _scale_of(q, scale))
    return _seq_first(out), lse


def _fast_lse_backward(dout, q, k, v, out, lse, *, causal, scale=None):
    kh, vh = _kernel_kv(q, k, v)
    # the kernels want out and dout in q's dtype and lse in their accumulation dtype
    dq, dk, dv = _kernel_backward(_heads_first(dout.to(q.dtype)), _heads_first(q), kh, vh,
                                  _heads_first(out.to(q.dtype)), lse.to(_lse_dtype(q)), causal,
                                  _scale_of(q, scale))
    if dk.shape[1] != k.shape[2]:
        dk, dv = _sum_groups(dk, k.shape[2]), _sum_groups(dv, k.shape[2])
    return _seq_first(dq), _seq_first(dk), _seq_first(dv)


def _fast_lse_supports(q, k, v, **_):
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        return f"mixed or non-float dtypes {q.dtype}/{k.dtype}/{v.dtype}"
    if q.device.type == "cpu":
        return None
    if q.device.type != "cuda":
        return f"device {q.device.type} (PyTorch's kernels returning the lse are for cpu and cuda)"
    if q.dtype == torch.float64:
        return "float64 (the CUDA efficient kernel serves fp16, bf16 and fp32)"
    align = 4 if q.dtype == torch.float32 else 8  # its GEMM alignment rule for the head dim
    if q.shape[-1] % align:
        return f"head dim {q.shape[-1]} (the CUDA efficient kernel wants a multiple of {align})"
    return None


# ------------------------------------------------------------------------------------------- npu
def _npu_block_mask(causal, device):
    """(atten_mask, sparse_mode): the documented compressed causal triangle for a diagonal block."""
    if not causal:
        return None, 0
    return causal_mask(NPU_COMPRESSED_MASK, NPU_COMPRESSED_MASK, device), 2


def _npu_lse(q, k, v, *, causal, scale=None):
    sq, b, n, d = q.shape
    sk, ng = k.shape[0], k.shape[2]
    atten_mask, sparse_mode = _npu_block_mask(causal, q.device)
    out, softmax_max, softmax_sum = npu_module().npu_fusion_attention(
        q.reshape(sq, b, n * d), k.reshape(sk, b, ng * d), v.reshape(sk, b, ng * d), n, "SBH",
        atten_mask=atten_mask, scale=_scale_of(q, scale), keep_prob=1.0, sparse_mode=sparse_mode,
    )[:3]
    lse = softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())
    return out.reshape(sq, b, n, d), lse


def _npu_lse_backward(dout, q, k, v, out, lse, *, causal, scale=None):
    sq, b, n, d = q.shape
    sk, ng = k.shape[0], k.shape[2]
    atten_mask, sparse_mode = _npu_block_mask(causal, q.device)
    lanes = lse.float().unsqueeze(-1).expand(*lse.shape, 8).contiguous()
    dq, dk, dv = npu_module().npu_fusion_attention_grad(
        q.reshape(sq, b, n * d), k.reshape(sk, b, ng * d), v.reshape(sk, b, ng * d),
        dout.to(q.dtype).reshape(sq, b, n * d), n, "SBH", atten_mask=atten_mask,
        softmax_max=lanes, softmax_sum=torch.ones_like(lanes), attention_in=out.to(q.dtype).reshape(sq, b, n * d),
        scale_value=_scale_of(q, scale), keep_prob=1.0, sparse_mode=sparse_mode,
    )[:3]
    return dq.reshape(sq, b, n, d), dk.reshape(sk, b, ng, d), dv.reshape(sk, b, ng, d)


attention_lse_op = Op(
    "attention_with_lse",
    npu=Impl(_npu_lse, lambda q, k, v, *, causal, scale=None: _npu_supports(q, k, v, causal=causal)),
    fast=Impl(_fast_lse, _fast_lse_supports),
    eager=Impl(_eager_lse),
)
attention_lse_backward_op = Op(
    "attention_lse_backward",
    npu=Impl(_npu_lse_backward, lambda dout, q, k, v, out, lse, *, causal, scale=None:
             _npu_supports(q, k, v, causal=causal)),
    fast=Impl(_fast_lse_backward, lambda dout, q, k, v, out, lse, **_: _fast_lse_supports(q, k, v)),
    eager=Impl(_eager_lse_backward),
)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                       scale: float | None = None, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [sq, b, np, hn] over k, v [sk, b, ng, hn] -> (out [sq, b, np, hn] in q's dtype,
    lse [b, np, sq] float32); ``causal`` only for sq == sk. No autograd: ``attention_lse_backward`` is
    the gradient."""
    _check_block("attention_with_lse", q, k, v, causal)
    return attention_lse_op(q, k, v, causal=causal, scale=scale, backend=backend)


def attention_lse_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float | None = None,
                           backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq [sq, b, np, hn], dk, dv [sk, b, ng, hn]) of one block, in the inputs' dtypes, from the rows'
    final ``out`` and ``lse`` (a ring passes its merged ones); kv gradients summed over the GQA group."""
    _check_block("attention_lse_backward", q, k, v, causal)
    sq, b, n, _ = q.shape
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != (b, n, sq):
        raise ValueError(f"attention_lse_backward: dout and out must be {tuple(q.shape)} and lse {(b, n, sq)}; "
                         f"got {tuple(dout.shape)}, {tuple(out.shape)}, {tuple(lse.shape)}")
    return attention_lse_backward_op(dout, q, k, v, out, lse, causal=causal, scale=scale, backend=backend)


def merge_attention(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                    block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the same query rows over two disjoint key sets, from each one's (out [sq, b, np, hn],
    lse [b, np, sq]): returns (out, lse) over their union, in fp32 (or wider). Stable for any lse: both
    weights exp(lse_i - lse) are at most 1."""
    dt = torch.promote_types(torch.promote_types(lse.dtype, block_lse.dtype), torch.float32)
    merged = torch.logaddexp(lse.to(dt), block_lse.to(dt))
    weight = torch.exp(lse - merged).permute(2, 0, 1).unsqueeze(-1)  # [sq, b, np, 1]
    block_weight = torch.exp(block_lse - merged).permute(2, 0, 1).unsqueeze(-1)
    return out.to(merged.dtype) * weight + block_out.to(merged.dtype) * block_weight, merged
