"""Rotary position embedding for megatron's [s, b, n, d] ("sbhd"/"bshd") layout.

``apply_rotary(t, freqs)`` gives what megatron-core's unfused ``_apply_rotary_pos_emb_bshd`` gives:

- ``t`` is [s, b, n, d]; ``freqs`` holds angles broadcastable to [s, b, 1, rot_dim] (usually
  [s, 1, 1, rot_dim]); with ``rot_dim < d`` only the first ``rot_dim`` channels rotate and the rest
  pass through unchanged (partial rotary);
- cos and sin are taken in the angles' dtype, multiplied by ``mscale`` and only then cast to
  ``t.dtype``; the rotation itself runs in ``t.dtype``;
- ``interleaved=False`` pairs channel i with channel i + rot_dim/2 ("rotate half");
  ``interleaved=True`` pairs channels 2i and 2i+1;
- ``mla_interleaved=True`` (megatron's ``mla_rotary_interleaved``, used by multi-latent attention)
  first regroups the rotated channels as [even channels, odd channels] and leaves them in that order
  in the output. Covered with ``interleaved=False`` by every backend; the rare combination with
  ``interleaved=True`` is served by the eager reference only.

Backends:

- eager: the reference, written term by term like the formula;
- fast: an autograd function that saves only cos and sin (no activation): a rotation is linear in
  ``t``, so the backward pass is the same rotation by the opposite angle. For the rotate-half pairing
  (Llama-family RoPE, partial rotary included) forward and backward are each one ``torch.compile``d
  expression, which inductor turns into a single pass that reads ``t``, cos and sin once and writes
  the result (16-bit inputs are computed in fp32 inside that pass and rounded once, where the eager
  formula rounds each product). Interleaved and MLA pairings use a hand-written function that writes
  each output half straight into the result with ``mul(out=)`` + ``addcmul_`` (two passes, no
  rotate-half copies, no concatenation; in bf16 too, where it now measured faster than the plain
  formula), as does every pairing if compiling fails (noticed once).
  cos and sin are computed once per angles tensor and reused while it is unchanged (megatron hands
  the same angles to every layer's q and k; see ``_cached_cos_sin``).
  Measured on CPU at bench/ops.py's shape, forward + backward, fp32 and bf16: the compiled expression
  with the cached cos/sin (what fast runs) is the fastest, ahead of the same with cos/sin computed per
  call, then the hand-written function, then megatron's ``_apply_rotary_pos_emb_bshd`` and the eager
  reference (figures in docs/features/fused-kernels.md, "Backend choices"). (An earlier note here found
  torch.compile of the *eager* formula, with its rotate-half copies and concatenation, slower than the
  hand-written function; compiling the single expression above is what pays.) Compiling is paid once
  per graph (forward, backward; again once when a size first changes, e.g. k after q with
  grouped-query attention), and the first inductor compile of a process costs the most.
- npu: ``torch_npu.npu_rotary_mul(x, cos, sin)``, whose documented semantics are
  ``x * cos + rotate_half(x) * sin`` with the "rotate half" pairing on the last dim of a 4-D tensor.
  It serves the non-interleaved case (MLA regrouping done before the call, partial rotary by slicing);
  interleaved pairs fall back.
"""

from __future__ import annotations

import torch

from hyper_adaptor.ops.backend import Compiled, Impl, Op, need_npu_tensor, npu_module

__all__ = ["apply_rotary", "rope_op"]


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype, mscale: float):
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def _check_shapes(t: torch.Tensor, freqs: torch.Tensor) -> int:
    rot_dim = freqs.shape[-1]
    if t.dim() != 4:
        raise ValueError(f"apply_rotary: t must be [s, b, n, d], got shape {tuple(t.shape)}")
    if rot_dim > t.shape[-1] or rot_dim % 2:
        raise ValueError(f"apply_rotary: rotary dim {rot_dim} must be even and <= head dim {t.shape[-1]}")
    return rot_dim


# ----------------------------------------------------------------------------------------- eager
def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Pairs (a, b) become (-b, a)."""
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((-b, a), dim=-1).flatten(-2)
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _eager(t, freqs, *, interleaved=False, mla_interleaved=False, mscale=1.0):
    rot_dim = _check_shapes(t, freqs)
    x, rest = t[..., :rot_dim], t[..., rot_dim:]
    if mla_interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    cos, sin = _cos_sin(freqs, t.dtype, mscale)
    rotated = x * cos + _rotate_half(x, interleaved) * sin
    return torch.cat((rotated, rest), dim=-1)


# ------------------------------------------------------------------------------------------ fast
def _pairs(x: torch.Tensor, interleaved: bool):
    """The two members of each rotated pair, as views of x."""
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _input_pairs(t: torch.Tensor, rot_dim: int, interleaved: bool, mla: bool):
    # MLA regrouping [evens, odds] then rotate-half pairing means pair i = (t[2i], t[2i + 1]).
    return _pairs(t[..., :rot_dim], interleaved or mla)


def _rotate_into(a, b, cos_a, sin_a, cos_b, sin_b, out_a, out_b, inverse: bool):
    """out = R(theta) (a, b), or R(-theta) when ``inverse`` (the transpose, used by backward).

    Forward: out_a = a cos_a - b sin_a, out_b = b cos_b + a sin_b.
    Backward (transpose): out_a = a cos_a + b sin_b, out_b = b cos_b - a sin_a.
    """
    torch.mul(a, cos_a, out=out_a)
    torch.mul(b, cos_b, out=out_b)
    if inverse:
        out_a.addcmul_(b, sin_b)
        out_b.addcmul_(a, sin_a, value=-1)
    else:
        out_a.addcmul_(b, sin_a, value=-1)
        out_b.addcmul_(a, sin_b)


class _RotaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin, interleaved: bool, mla: bool):
        rot_dim = cos.shape[-1]
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        a, b = _input_pairs(t, rot_dim, interleaved, mla)
        out_a, out_b = _pairs(out[..., :rot_dim], interleaved)
        cos_a, cos_b = _pairs(cos, interleaved)
        sin_a, sin_b = _pairs(sin, interleaved)
        _rotate_into(a, b, cos_a, sin_a, cos_b, sin_b, out_a, out_b, inverse=False)
        out[..., rot_dim:] = t[..., rot_dim:]
        ctx.save_for_backward(cos, sin)
        ctx.flags = (interleaved, mla)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        interleaved, mla = ctx.flags
        rot_dim = cos.shape[-1]
        grad_t = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        ga, gb = _pairs(grad[..., :rot_dim], interleaved)
        out_a, out_b = _input_pairs(grad_t, rot_dim, interleaved, mla)
        cos_a, cos_b = _pairs(cos, interleaved)
        sin_a, sin_b = _pairs(sin, interleaved)
        _rotate_into(ga, gb, cos_a, sin_a, cos_b, sin_b, out_a, out_b, inverse=True)
        grad_t[..., rot_dim:] = grad[..., rot_dim:]
        return grad_t, None, None, None, None


def _rotate_half_math(t, cos, sin, inverse: bool):
    """The rotate-half rotation (``inverse``: its transpose, the backward) as one expression, for
    torch.compile to turn into a single pass over ``t``: read t, cos, sin once, write the result."""
    rot_dim = cos.shape[-1]
    half = rot_dim // 2
    a, b, rest = t[..., :half], t[..., half:rot_dim], t[..., rot_dim:]
    cos_a, cos_b, sin_a, sin_b = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    if inverse:
        return torch.cat((a * cos_a + b * sin_b, b * cos_b - a * sin_a, rest), dim=-1)
    return torch.cat((a * cos_a - b * sin_a, b * cos_b + a * sin_b, rest), dim=-1)


_MATH = Compiled("rope", _rotate_half_math)


class _CompiledRotaryFn(torch.autograd.Function):
    """Rotate-half RoPE with forward and backward each one compiled kernel; saves only cos and sin."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _MATH(t, cos, sin, False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _MATH(grad, cos, sin, True), None, None


# cos and sin of the angles megatron hands every layer (one tensor per step, or the same one for many
# steps: RotaryEmbedding caches it), so each layer's q and k after the first reuse them. Keyed by the
# angles' identity, checked against their version counter; the entry keeps the angles alive, so their
# id cannot be reused while it is cached.
_COS_SIN: dict = {}
_COS_SIN_ENTRIES = 4


def _cached_cos_sin(freqs: torch.Tensor, dtype: torch.dtype, mscale: float):
    try:
        version = freqs._version
    except RuntimeError:  # inference-mode tensors have no version counter: do not cache
        return _cos_sin(freqs, dtype, mscale)
    key = (id(freqs), dtype, float(mscale))
    hit = _COS_SIN.get(key)
    if hit is not None and hit[0] is freqs and hit[1] == version:
        return hit[2], hit[3]
    cos, sin = _cos_sin(freqs, dtype, mscale)
    if len(_COS_SIN) >= _COS_SIN_ENTRIES:
        _COS_SIN.pop(next(iter(_COS_SIN)))
    _COS_SIN[key] = (freqs, version, cos, sin)
    return cos, sin


def _fast(t, freqs, *, interleaved=False, mla_interleaved=False, mscale=1.0):
    _check_shapes(t, freqs)
    cos, sin = _cached_cos_sin(freqs, t.dtype, mscale)
    if not (interleaved or mla_interleaved or _MATH.failed):
        return _CompiledRotaryFn.apply(t, cos, sin)  # (the uncompiled math if compilation fails)
    return _RotaryFn.apply(t, cos, sin, interleaved, mla_interleaved)


def _fast_supports(t, freqs, *, interleaved=False, mla_interleaved=False, mscale=1.0):
    if freqs.requires_grad:
        return "the angles require grad (the fused backward only differentiates t)"
    if interleaved and mla_interleaved:
        return "MLA regrouping combined with interleaved pairs"
    if t.dim() != 4 or freqs.shape[-1] > t.shape[-1] or freqs.shape[-1] % 2:
        return "shape outside [s, b, n, d] with an even rotary dim <= d"
    try:
        torch.broadcast_shapes(freqs.shape[:-1], t.shape[:-1])
    except RuntimeError:
        return f"angles of shape {tuple(freqs.shape)} do not broadcast over t {tuple(t.shape)}"
    return None


# ------------------------------------------------------------------------------------------- npu
def _npu(t, freqs, *, interleaved=False, mla_interleaved=False, mscale=1.0):
    rot_dim = freqs.shape[-1]
    x, rest = t[..., :rot_dim], t[..., rot_dim:]
    if mla_interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    cos, sin = _cos_sin(freqs, t.dtype, mscale)
    rotated = npu_module().npu_rotary_mul(x.contiguous(), cos, sin)
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


def _npu_supports(t, freqs, *, interleaved=False, mla_interleaved=False, mscale=1.0):
    reason = need_npu_tensor(t, freqs)
    if reason:
        return reason
    if interleaved:
        return "npu_rotary_mul pairs channels as rotate-half, not interleaved"
    if t.dim() != 4 or freqs.dim() != 4:
        return "npu_rotary_mul takes 4-D tensors"
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {t.dtype}"
    if freqs.requires_grad:
        return "the angles require grad"
    return None


rope_op = Op(
    "rope",
    npu=Impl(_npu, _npu_supports),
    fast=Impl(_fast, _fast_supports),
    eager=Impl(_eager),
)


def apply_rotary(t: torch.Tensor, freqs: torch.Tensor, *, interleaved: bool = False,
                 mla_interleaved: bool = False, mscale: float = 1.0, backend: str | None = None):
    """Rotate ``t`` [s, b, n, d] by the angles ``freqs`` [s, 1|b, 1, rot_dim]; see the module doc."""
    return rope_op(t, freqs, interleaved=interleaved, mla_interleaved=mla_interleaved,
                   mscale=mscale, backend=backend)
