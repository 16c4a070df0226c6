"""RMSNorm over the last dimension: ``y = x / sqrt(mean(x**2) + eps) * weight``.

Numerics follow megatron-core's local layer spec, whose ``WrappedTorchNorm`` builds
``torch.nn.RMSNorm`` (``F.rms_norm``). With torch 2.13 that computes, for 16-bit inputs too, the
normalisation *and* the product with the weight in fp32 and rounds once to ``x.dtype`` (checked
bit for bit on CPU, fp32 and bf16, forward and backward). The eager reference here does exactly
that, so it is the same function as megatron's, not an approximation of it.

Backends:

- eager: the reference, ``((x.float() * rsqrt(mean(x.float()**2) + eps)) * weight.float()).to(x.dtype)``,
  differentiated by autograd;
- fast: on CUDA tensors ``F.rms_norm`` itself, torch's native fused kernel: exactly what megatron's
  local spec runs, so the result is megatron's bit for bit. On an NVIDIA H100, ``bench/ops.py``
  measured, before this change, ``F.rms_norm`` clearly faster than the compiled reference (bf16 at
  scale 1, fp32 at scale 4; docs/features/fused-kernels.md, "On a GPU"). The CUDA branch was
  written after that measurement; ``tests/gpu/test_cuda_fast_ops.py`` checks it (bitwise against
  ``torch.nn.RMSNorm``, forward and backward) and passed on an H200 (docs/gpu.md).

  On every other device (CPU), ``torch.compile`` of that reference on a 2-D ``[tokens, hidden]`` view
  (so only two sizes can change between calls). Measured on CPU, forward + backward, fp32 and bf16,
  the compiled reference is far faster than both eager and ``F.rms_norm`` (figures in
  docs/features/fused-kernels.md, "Backend choices"). Compilation is paid once per new dtype (and once
  more when the shape first changes), once per training run, so the compiled reference is the fast
  path there. Where compilation is impossible (no C++ compiler, no Triton) the first failure is
  noticed once and ``F.rms_norm`` serves from then on.
- npu: ``torch_npu.npu_rms_norm(x, gamma, epsilon=eps)``, which returns ``(y, rstd)``; it needs the
  weight in the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyper_adaptor.ops.backend import Compiled, Impl, Op, need_npu_tensor, npu_module

__all__ = ["rms_norm", "rms_norm_op", "FusedRMSNorm"]


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} does not match the last dim "
                         f"of x {tuple(x.shape)}")


# ----------------------------------------------------------------------------------------- eager
def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * inv_rms * weight.float()).to(x.dtype)


def _eager(x, weight, eps=1e-5):
    _check(x, weight)
    return _reference(x, weight, eps)


# ------------------------------------------------------------------------------------------ fast
def _torch_fused(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


_COMPILED = Compiled("rms_norm", _reference, _torch_fused, "F.rms_norm")


# device types on which the fast backend runs F.rms_norm rather than the compiled reference
_FUSED_DEVICES = frozenset({"cuda"})


def _fast_kernel_for(x: torch.Tensor) -> str:
    """``"fused"`` (``F.rms_norm``) for a tensor on CUDA, ``"compiled"`` (the compiled reference)
    elsewhere; see the module docstring for the measurements behind it."""
    return "fused" if x.device.type in _FUSED_DEVICES else "compiled"


def _fast(x, weight, eps=1e-5):
    _check(x, weight)
    if _fast_kernel_for(x) == "fused":
        return _torch_fused(x, weight, eps)
    return _COMPILED(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def _fast_supports(x, weight, eps=1e-5):
    if not (x.is_floating_point() and weight.is_floating_point()):
        return f"dtype {x.dtype} is not a float type"
    return None


# ------------------------------------------------------------------------------------------- npu
def _npu(x, weight, eps=1e-5):
    _check(x, weight)
    y, _rstd = npu_module().npu_rms_norm(x, weight, epsilon=eps)
    return y


def _npu_supports(x, weight, eps=1e-5):
    reason = need_npu_tensor(x, weight)
    if reason is None and weight.dtype != x.dtype:
        reason = f"weight dtype {weight.dtype} differs from input dtype {x.dtype}"
    return reason


rms_norm_op = Op(
    "rms_norm",
    npu=Impl(_npu, _npu_supports),
    fast=Impl(_fast, _fast_supports),
    eager=Impl(_eager),
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *, backend: str | None = None):
    """RMSNorm of ``x`` over its last dim, scaled by ``weight``; result in ``x.dtype``."""
    return rms_norm_op(x, weight, eps, backend=backend)


class FusedRMSNorm(torch.nn.Module):
    """Drop-in for the local spec's ``torch.nn.RMSNorm(hidden_size, eps)`` that runs :func:`rms_norm`.

    ``zero_centered_gamma=True`` (megatron's ``layernorm_zero_centered_gamma``) stores ``gamma - 1``:
    the weight starts at 0 and the op is given ``weight + 1``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, zero_centered_gamma: bool = False,
                 dtype: torch.dtype | None = None, device=None, backend: str | None = None):
        super().__init__()
        self.hidden_size, self.eps = int(hidden_size), float(eps)
        self.zero_centered_gamma, self.backend = bool(zero_centered_gamma), backend
        self.weight = torch.nn.Parameter(torch.empty(self.hidden_size, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return rms_norm(x, weight, self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"
