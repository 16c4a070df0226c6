"""Attention blocks with their log-sum-exp: the op under ring attention.

Ring and all-gather context parallel (hyper_adaptor/parallel/context) see one key/value block at a
time; with s = q k^T * scale and each row's log-sum-exp lse = log(sum_j exp(s_j)), partial results
over disjoint key sets combine exactly (``merge_attention``):
    lse = logaddexp(lse_1, lse_2),   out = exp(lse_1 - lse) * out_1 + exp(lse_2 - lse) * out_2.
A block's backward needs only the row's FINAL out and lse, not the block's partial ones:
P = exp(s - lse) is the block's slice of the full softmax, so with D = rowsum(dout * out)
    dv = P^T dout,   dS = P * (dout v^T - D),   dq = dS k * scale,   dk = dS^T q * scale.

Dropout (context parallel's attention dropout): with a keep-mask M of the block and keep scale
1 / (1 - p), the forward is out = (P * M / (1 - p)) v with the lse of the UNMASKED scores (so merging is
unchanged), and with the final out and lse
    dv = (P * M / (1 - p))^T dout,   dS = P * ((dout v^T) * M / (1 - p) - D);
D = rowsum(dout * out) stays right because out is the dropped output. The caller passes the block's mask
(``keep``) in both passes; hyper_adaptor/parallel/context/_dropout.py regenerates it from a seed.

Layouts: q [sq, b, np, hn], k/v [sk, b, ng, hn] -> out [sq, b, np, hn] in q's dtype, lse [b, np, sq]
float32 (float64 for float64 inputs). causal=True only for a diagonal block (sq == sk, the lower
triangle): a ring never needs an offset causal block, and refusing one keeps the kernels' different
alignments (PyTorch's top-left, megatron's bottom-right) out of the question.

Backends:
- eager: the formulas above with plain matmuls in fp32 (the reference); kv heads repeated for GQA and
  their gradients summed back over the group. The only backend that takes a dropout mask: PyTorch's
  kernels and torch_npu's draw their own masks from their own RNG (or none, the CPU flash kernel), which
  cannot follow a mask given per block by global position, so a call with ``keep`` runs eager on any
  device (one notice when another backend was first in line).
- fast: PyTorch's private kernels that return the lse (reached only from ``_kernel_forward`` /
  ``_kernel_backward``). CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which
  serve GQA without copying (query head h reads kv head h // (np // ng)) and take any out/lse. CUDA:
  ``_scaled_dot_product_efficient_attention`` and its backward, with kv heads repeated (the kernel wants
  as many kv heads as query heads) and the lse it pads along the queries to a multiple of 32 cut off
  (and padded back for the backward). Untested here: this machine has no GPU.
- npu: ``npu_fusion_attention`` (SBH, GQA native) returns softmax_max and softmax_sum, documented as
  fp32 [b, np, sq, 8] with 8 equal lanes: lse = max + log(sum). ``npu_fusion_attention_grad`` rebuilds
  P = exp(s - softmax_max) / softmax_sum, so softmax_max = the final lse and softmax_sum = 1 give the
  block's slice of the final softmax. fp16/bf16, head dim a multiple of 16 up to 512, as ``attention``.
  Written against torch_npu's documented API; untested here (no torch_npu).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hyper_adaptor.ops.attention import NPU_COMPRESSED_MASK, _check, _heads_first, _npu_supports, causal_mask
from hyper_adaptor.ops.backend import Impl, Op, notice, npu_module

__all__ = ["attention_with_lse", "attention_lse_backward", "attention_lse_op", "attention_lse_backward_op",
           "merge_attention"]


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


def _dropped(probs, keep, dropout_p):
    return probs if keep is None else probs * keep.to(probs.dtype) * (1.0 / (1.0 - dropout_p))


def _eager_lse(q, k, v, *, causal, scale=None, keep=None, dropout_p=0.0):
    _, _, scores = _eager_scores(q, k, causal, _scale_of(q, scale))
    lse = torch.logsumexp(scores, dim=-1)
    vh = _heads_first(v).to(lse.dtype).repeat_interleave(q.shape[2] // k.shape[2], dim=1)
    out = torch.matmul(_dropped(torch.exp(scores - lse.unsqueeze(-1)), keep, dropout_p), vh)
    return _seq_first(out).to(q.dtype), lse


def _eager_lse_backward(dout, q, k, v, out, lse, *, causal, scale=None, keep=None, dropout_p=0.0):
    scale = _scale_of(q, scale)
    qh, kh, scores = _eager_scores(q, k, causal, scale)
    dt, ng = scores.dtype, k.shape[2]
    probs = torch.exp(scores - lse.to(dt).unsqueeze(-1))
    vh = _heads_first(v).to(dt).repeat_interleave(q.shape[2] // ng, dim=1)
    do, o = _heads_first(dout).to(dt), _heads_first(out).to(dt)
    dv = torch.matmul(_dropped(probs, keep, dropout_p).transpose(-1, -2), do)
    dprobs = _dropped(torch.matmul(do, vh.transpose(-1, -2)), keep, dropout_p)
    ds = probs * (dprobs - (do * o).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, kh)
    dk = torch.matmul(ds.transpose(-1, -2), qh)
    return (_seq_first(dq).to(q.dtype), _seq_first(_sum_groups(dk, ng)).to(k.dtype),
            _seq_first(_sum_groups(dv, ng)).to(v.dtype))


# ------------------------------------------------------------------------------------------ fast
# PyTorch's private SDPA kernels (hyper_adaptor/platform/torch_private.py). These two functions are the only
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


def _check_keep(name, q, k, keep, dropout_p):
    shape = (q.shape[1], q.shape[2], q.shape[0], k.shape[0])
    if keep is None:
        if dropout_p:
            raise ValueError(f"{name}: dropout_p={dropout_p} needs the block's keep mask")
        return
    if keep.dtype != torch.bool or tuple(keep.shape) != shape or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{name}: keep must be a bool mask {shape} [b, np, sq, sk] and dropout_p in [0, 1); "
                         f"got {keep.dtype} {tuple(keep.shape)}, dropout_p={dropout_p}")


def _eager_for_dropout(op, backend):
    first = op.chain(backend)[0]
    if first != "eager":
        notice(op.name, first, "attention dropout with a mask given per block (context parallel)", "eager")
    op.calls["eager"] += 1


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                       scale: float | None = None, backend: str | None = None, keep: torch.Tensor | None = None,
                       dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [sq, b, np, hn] over k, v [sk, b, ng, hn] -> (out [sq, b, np, hn] in q's dtype,
    lse [b, np, sq] float32); ``causal`` only for sq == sk. No autograd: ``attention_lse_backward`` is
    the gradient. ``keep`` (bool [b, np, sq, sk]) with ``dropout_p``: attention dropout with that mask
    (eager backend); the lse is the unmasked one."""
    _check_block("attention_with_lse", q, k, v, causal)
    _check_keep("attention_with_lse", q, k, keep, dropout_p)
    if keep is not None:
        _eager_for_dropout(attention_lse_op, backend)
        return _eager_lse(q, k, v, causal=causal, scale=scale, keep=keep, dropout_p=dropout_p)
    return attention_lse_op(q, k, v, causal=causal, scale=scale, backend=backend)


def attention_lse_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float | None = None,
                           backend: str | None = None, keep: torch.Tensor | None = None,
                           dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq [sq, b, np, hn], dk, dv [sk, b, ng, hn]) of one block, in the inputs' dtypes, from the rows'
    final ``out`` and ``lse`` (a ring passes its merged ones); kv gradients summed over the GQA group.
    ``keep`` and ``dropout_p``: the mask the forward used (eager backend)."""
    _check_block("attention_lse_backward", q, k, v, causal)
    sq, b, n, _ = q.shape
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != (b, n, sq):
        raise ValueError(f"attention_lse_backward: dout and out must be {tuple(q.shape)} and lse {(b, n, sq)}; "
                         f"got {tuple(dout.shape)}, {tuple(out.shape)}, {tuple(lse.shape)}")
    _check_keep("attention_lse_backward", q, k, keep, dropout_p)
    if keep is not None:
        _eager_for_dropout(attention_lse_backward_op, backend)
        return _eager_lse_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, keep=keep,
                                   dropout_p=dropout_p)
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
