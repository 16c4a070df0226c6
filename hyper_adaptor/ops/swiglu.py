"""SwiGLU: ``x[..., 2h] -> silu(x1) * x2`` with ``x1, x2 = x.chunk(2, dim=-1)``.

The halves are taken as megatron-core takes them (``torch.chunk(y, 2, -1)`` in
``fusions/fused_bias_swiglu.py`` and in the unfused ``glu`` of ``transformer/mlp.py``): the *first*
half goes through SiLU, the second is the linear gate. ``bias_swiglu(x, bias)`` adds the bias first.

Backends:

- eager: one ``torch.autograd.Function`` that saves only its input (and the bias), never the
  SiLU intermediate, and computes the backward by formula — with ``s = sigmoid(x1)``::

      d/dx1 = g * x2 * s * (1 + x1 * (1 - s)),   d/dx2 = g * x1 * s,   d/dbias = sum of both over tokens

  ``x + bias`` is rounded to the input dtype (as megatron's unfused MLP and npu_swiglu see it); the
  rest runs in fp32 and is rounded once (megatron's unfused path rounds after SiLU and again after
  the product, so bf16 results agree to about one or two bf16 ulps).
  ``fp8_input_store=True`` saves the input as float8_e4m3fn instead, as megatron's fused function does.
- fast: the same function with its forward and backward math under ``torch.compile``: on CPU, forward
  + backward, the compiled function is the fastest measured in fp32 and bf16, ahead of megatron's
  unfused ``F.silu(x1) * x2`` and well ahead of the function uncompiled; compiling is paid once per
  dtype (figures in docs/features/fused-kernels.md, "Backend choices"). Where compilation is
  impossible the first failure is noticed once and the uncompiled function serves from then on.
- npu: ``torch_npu.npu_swiglu(x, dim=-1)``, which splits ``x`` into two halves along ``dim`` and
  returns ``silu(first) * second`` (differentiable; torch_npu registers its backward). The bias is
  added before the call; fp8 input storage is not offered there, so such calls fall back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyper_adaptor.ops.backend import Compiled, Impl, Op, need_npu_tensor, npu_module

__all__ = ["swiglu", "bias_swiglu", "swiglu_op"]


def _check(x: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim of x must be even (two halves), got shape {tuple(x.shape)}")
    if bias is not None and bias.shape[-1] != x.shape[-1]:
        raise ValueError(f"swiglu: bias of shape {tuple(bias.shape)} does not match x {tuple(x.shape)}")


# ---------------------------------------------------------------------------- math (fwd and bwd)
def _biased(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The sum is rounded to the input dtype, as megatron's unfused MLP and npu_swiglu see it. It is
    # kept out of the compiled math so that one compiled graph serves calls with and without a bias.
    return x if bias is None else x + bias


def _forward_math(y: torch.Tensor) -> torch.Tensor:
    gate, linear = y.float().chunk(2, dim=-1)
    return (F.silu(gate) * linear).to(y.dtype)


def _backward_math(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    gate, linear = y.float().chunk(2, dim=-1)
    g = grad.float()
    sig = torch.sigmoid(gate)
    d_gate = g * linear * sig * (1 + gate * (1 - sig))
    d_linear = g * gate * sig
    return torch.cat((d_gate, d_linear), dim=-1)  # fp32; the caller rounds


_FORWARD = Compiled("swiglu", _forward_math)
_BACKWARD = Compiled("swiglu", _backward_math)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, use_compiled, fp8_input_store, cpu_offload_input):
        y = _biased(x, bias)
        out = (_FORWARD if use_compiled else _forward_math)(y)
        stored = x.to(torch.float8_e4m3fn) if fp8_input_store else x
        if cpu_offload_input:  # the marking megatron's own function sets for activation offloading
            stored.activation_offloading = True
            if bias is not None:
                bias.activation_offloading = True
        ctx.save_for_backward(stored, bias)
        ctx.input_dtype, ctx.use_compiled = x.dtype, use_compiled
        return out

    @staticmethod
    def backward(ctx, grad):
        stored, bias = ctx.saved_tensors
        x = stored.to(ctx.input_dtype) if stored.dtype != ctx.input_dtype else stored
        y = _biased(x, bias)
        grad_y = (_BACKWARD if ctx.use_compiled else _backward_math)(grad, y)
        grad_x = grad_y.to(ctx.input_dtype) if ctx.needs_input_grad[0] else None
        grad_bias = None
        if bias is not None and ctx.needs_input_grad[1]:
            lead = grad_y.dim() - bias.dim()
            grad_bias = grad_y.sum(dim=tuple(range(lead))) if lead > 0 else grad_y
            grad_bias = grad_bias.sum_to_size(bias.shape).to(bias.dtype)
        return grad_x, grad_bias, None, None, None


def _eager(x, bias=None, *, fp8_input_store=False, cpu_offload_input=False):
    _check(x, bias)
    return _SwiGLUFunction.apply(x, bias, False, fp8_input_store, cpu_offload_input)


def _fast(x, bias=None, *, fp8_input_store=False, cpu_offload_input=False):
    _check(x, bias)
    return _SwiGLUFunction.apply(x, bias, True, fp8_input_store, cpu_offload_input)


def _fast_supports(x, bias=None, **_):
    if not x.is_floating_point():
        return f"dtype {x.dtype} is not a float type"
    return None


# ------------------------------------------------------------------------------------------- npu
def _npu(x, bias=None, *, fp8_input_store=False, cpu_offload_input=False):
    _check(x, bias)
    y = x if bias is None else x + bias
    return npu_module().npu_swiglu(y, dim=-1)


def _npu_supports(x, bias=None, *, fp8_input_store=False, cpu_offload_input=False):
    if fp8_input_store:
        return "fp8 input storage is not offered by npu_swiglu"
    return need_npu_tensor(x, bias)


swiglu_op = Op(
    "swiglu",
    npu=Impl(_npu, _npu_supports),
    fast=Impl(_fast, _fast_supports),
    eager=Impl(_eager),
)


def swiglu(x: torch.Tensor, *, backend: str | None = None, **options) -> torch.Tensor:
    """``silu(x1) * x2`` for ``x1, x2 = x.chunk(2, -1)``; options: fp8_input_store, cpu_offload_input."""
    return swiglu_op(x, None, backend=backend, **options)


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None, *, backend: str | None = None,
                **options) -> torch.Tensor:
    """:func:`swiglu` of ``x + bias`` (``bias`` may be None)."""
    return swiglu_op(x, bias, backend=backend, **options)
