"""Weight-gradient GEMM accumulated in place into ``main_grad`` (gradient accumulation fusion).

``wgrad_accum(total_input, grad_output, main_grad)`` does ``main_grad += grad_output^T @ total_input``
with both inputs flattened to 2-D (``[tokens, in]`` and ``[tokens, out]``; ``main_grad`` is
``[out, in]``). It is what Megatron's linear layers expect from apex's ``fused_weight_gradient_mlp_cuda``
when ``gradient_accumulation_fusion`` is on; ``KERNELS`` is a stand-in for that module.

Precision (the contract every backend keeps): the product is accumulated in fp32 (fp64 for an fp64
``main_grad``) and added to ``main_grad`` with one rounding to its dtype, the arithmetic of apex's
kernels (a GEMM with fp32 accumulator and ``beta = 1``). A product of two bf16/fp16 values is exact in
fp32, so upcasting the inputs first and running an fp32 GEMM is the same computation, not an
approximation; only the summation order of the GEMM differs from device to device. In particular a
bf16 product is never rounded to bf16 before it is added (as ``main_grad.add_(g.t() @ x)`` would do).

Backends (see ``backend.py``):

- ``eager``: upcast, ``main_grad.addmm_`` (or, for a half ``main_grad``, add in fp32 and copy back).
- ``fast``: on CPU the same formulation, picked by measurement (figures in
  docs/features/fused-kernels.md, "Backend choices"): with fp32 inputs ``addmm_`` and ``mm`` +
  ``add_`` are equal within noise (``addmm_`` allocates no ``[out, in]`` temporary); with bf16 inputs
  into fp32, upcast + ``addmm_`` is the fastest, ahead of upcast + ``mm`` + ``add_`` and far ahead of
  a native bf16 ``mm`` (which also rounds the product to bf16, so is wrong here).
  ``torch.mm(..., out_dtype=float32)`` has no CPU kernel in torch 2.13. It skips the reshape and casts
  that are no-ops.

  On CUDA, with fp16/bf16 inputs (both the same) and an fp32 ``main_grad``, it runs
  ``torch.mm(g.t(), x, out_dtype=torch.float32)`` (``aten::mm.dtype``: a half GEMM on the tensor
  cores that accumulates in fp32 and writes fp32) and then ``main_grad.add_`` it: the same contract
  (exact half products, fp32 accumulation, one rounding into ``main_grad``; only the summation order
  differs). Why: on an NVIDIA H100, ``bench/ops.py --scale 1 --dtype bf16`` measured the upcast path
  for bf16 inputs into an fp32 ``main_grad`` far slower than megatron's unfused bf16 path: the upcast
  runs an fp32 GEMM, an order of magnitude slower than a bf16 one there (docs/features/fused-kernels.md,
  "On a GPU", wgrad accumulate row of the scale-1 table). The out_dtype path was written
  after that measurement; ``tests/gpu/test_cuda_fast_ops.py`` checks it (accuracy against fp64, and
  that the path is taken) and passed on an H200 (docs/gpu.md). It is used only
  when this torch has ``aten::mm.dtype`` (detected once at import); if the call raises (an older
  torch, a dtype combination cuBLAS refuses) that is noticed once, the upcast path serves the call,
  and the out_dtype path is not tried again in this process (``OUT_DTYPE_MM.failed`` says why; out
  of memory is the call's own error and propagates). ``OUT_DTYPE_MM.calls`` counts the calls it
  served. Half ``main_grad`` and fp32 inputs keep the upcast path on every device.
- ``npu``: torch_npu's in-place grouped matmul-add (``npu_grouped_matmul_add_``, fp16/bf16 inputs
  accumulated into an fp32 buffer) with a single group spanning all tokens. Not verified on Ascend
  hardware here; any call it cannot serve falls back with a notice.
"""

from __future__ import annotations

import types

import torch

from hyper_adaptor.ops.backend import Impl, Op, TriedUntilFailed, need_npu_tensor, npu_module

__all__ = ["wgrad_accum", "WGRAD_ACCUM", "KERNELS", "OUT_DTYPE_MM"]

_HALF = (torch.float16, torch.bfloat16)


def _has_mm_out_dtype() -> bool:
    """Whether this torch has ``aten::mm.dtype`` (``torch.mm(a, b, out_dtype=...)``)."""
    try:
        return "out_dtype" in str(torch.ops.aten.mm.dtype._schema)
    except (AttributeError, RuntimeError):
        return False


def _flat(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor):
    """Both inputs as 2-D ``[tokens, features]``, checked against ``main_grad`` ``[out, in]``."""
    x = total_input if total_input.dim() == 2 else total_input.reshape(-1, total_input.shape[-1])
    g = grad_output if grad_output.dim() == 2 else grad_output.reshape(-1, grad_output.shape[-1])
    if x.shape[0] != g.shape[0] or main_grad.shape != (g.shape[1], x.shape[1]):
        raise ValueError(
            f"wgrad_accum: total_input {tuple(total_input.shape)} and grad_output "
            f"{tuple(grad_output.shape)} do not give main_grad's shape {tuple(main_grad.shape)} "
            f"([tokens, in] and [tokens, out] into [out, in])")
    return x, g


def _acc_dtype(main_grad: torch.Tensor) -> torch.dtype:
    # fp32 accumulation at least; a wider main_grad keeps its own width.
    return torch.promote_types(main_grad.dtype, torch.float32)


def _eager(total_input, grad_output, main_grad):
    x, g = _flat(total_input, grad_output, main_grad)
    acc = _acc_dtype(main_grad)
    product_inputs = (g.t().to(acc), x.to(acc))
    if main_grad.dtype == acc:
        main_grad.addmm_(*product_inputs)
    else:  # half main_grad: sum in fp32, round once
        main_grad.copy_(main_grad.to(acc).addmm_(*product_inputs))
    return main_grad


def _op_failed(exc: BaseException) -> bool:
    """An error of ``aten::mm.dtype`` itself (missing kernel, a dtype cuBLAS refuses); out of memory is
    the call's own."""
    return isinstance(exc, (RuntimeError, NotImplementedError, TypeError)) and not isinstance(
        exc, torch.OutOfMemoryError)


def _use_out_dtype_mm(x: torch.Tensor, g: torch.Tensor, main_grad: torch.Tensor) -> bool:
    """Whether the fast backend computes this call with ``torch.mm(..., out_dtype=float32)``: half
    inputs (the same dtype) into an fp32 ``main_grad``, all on a device in ``OUT_DTYPE_MM.devices``,
    on a torch that has the op, and the op has not failed before."""
    return (OUT_DTYPE_MM.available and OUT_DTYPE_MM.failed is None
            and x.device.type in OUT_DTYPE_MM.devices
            and g.device == x.device and main_grad.device == x.device
            and x.dtype in _HALF and g.dtype == x.dtype and main_grad.dtype == torch.float32)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b, out_dtype=torch.float32)


def _half_gemm(x, g, main_grad):
    main_grad.add_(_mm_fp32(g.t(), x))
    return main_grad


def _upcast(x, g, main_grad):
    acc = _acc_dtype(main_grad)
    gt = g.t() if g.dtype == acc else g.t().to(acc)
    x = x if x.dtype == acc else x.to(acc)
    if main_grad.dtype == acc:
        main_grad.addmm_(gt, x)
    else:
        main_grad.copy_(torch.addmm(main_grad.to(acc), gt, x))
    return main_grad


class _OutDtypeMM(TriedUntilFailed):
    """The fast backend's half-GEMM-into-fp32 path (see the module docstring). ``available``: this torch
    has the op (detected once); ``devices``: where it is tried (device types with an ``aten::mm.dtype``
    kernel); ``failed`` / ``calls``: :class:`~hyper_adaptor.ops.backend.TriedUntilFailed`'s."""

    available = _has_mm_out_dtype()
    devices = frozenset({"cuda"})


OUT_DTYPE_MM = _OutDtypeMM("wgrad_accum", "fast (torch.mm out_dtype=float32)", _half_gemm, _upcast,
                           "the fp32 upcast GEMM from now on", _op_failed)


def _fast(total_input, grad_output, main_grad):
    x, g = _flat(total_input, grad_output, main_grad)
    if _use_out_dtype_mm(x, g, main_grad):
        return OUT_DTYPE_MM(x, g, main_grad)
    return _upcast(x, g, main_grad)


def _npu_supports(total_input, grad_output, main_grad):
    reason = need_npu_tensor(total_input, grad_output, main_grad)
    if reason is not None:
        return reason
    if not hasattr(npu_module(), "npu_grouped_matmul_add_"):
        return "this torch_npu has no npu_grouped_matmul_add_"
    if main_grad.dtype != torch.float32:
        return f"main_grad is {main_grad.dtype}, the fused kernel accumulates into float32 only"
    if total_input.dtype not in _HALF or grad_output.dtype != total_input.dtype:
        return f"inputs are {total_input.dtype}/{grad_output.dtype}, the fused kernel takes fp16/bf16"
    if not main_grad.is_contiguous():
        return "main_grad is not contiguous"
    return None


def _npu(total_input, grad_output, main_grad):
    x, g = _flat(total_input, grad_output, main_grad)
    if x.shape[0] == 0:
        return main_grad  # nothing to add; the kernel rejects empty groups
    # One group covering all tokens (grouping is along the reduced token axis): [out, in] += g^T @ x.
    group_list = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    npu_module().npu_grouped_matmul_add_(main_grad.view(1, *main_grad.shape), g.contiguous(),
                                         x.contiguous(), group_list)
    return main_grad


WGRAD_ACCUM = Op(
    "wgrad_accum",
    eager=Impl(_eager),
    fast=Impl(_fast),
    # npu_grouped_matmul_add_ is not in torch_npu's deterministic-computing API list (as far as it was
    # read; not run on an NPU here); addmm (the fast backend) is, so --deterministic-mode uses that
    npu=Impl(_npu, _npu_supports, lambda *a, **k: "npu_grouped_matmul_add_ is not documented as deterministic "
             "under torch.use_deterministic_algorithms"),
)


def wgrad_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor, *,
                backend: str | None = None) -> torch.Tensor:
    """``main_grad += grad_output_2d^T @ total_input_2d`` in place (see the module docstring for the
    precision); returns ``main_grad``. Autograd does not see it (call it inside a backward)."""
    with torch.no_grad():
        return WGRAD_ACCUM(total_input, grad_output, main_grad, backend=backend)


def _accum_fp32(total_input, grad_output, main_grad):
    wgrad_accum(total_input, grad_output, main_grad)


def _accum_fp16(total_input, grad_output, main_grad):
    wgrad_accum(total_input, grad_output, main_grad)


# Stand-in for apex's fused_weight_gradient_mlp_cuda: the two entry points Megatron calls, with its
# argument order (input, grad_output, main_grad); the _fp16 one serves fp16 and bf16 main_grad.
KERNELS = types.SimpleNamespace(
    __name__="hyper_adaptor.ops.wgrad_accum.KERNELS",
    wgrad_gemm_accum_fp32=_accum_fp32,
    wgrad_gemm_accum_fp16=_accum_fp16,
)
