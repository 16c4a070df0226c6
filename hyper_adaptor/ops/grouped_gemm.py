"""Grouped GEMM: one linear map per group of rows, as MoE experts apply them to tokens sorted by expert.

``grouped_gemm(x, weights, tokens_per_group)`` returns ``[T, N]`` whose rows of group ``e`` are
``x_e @ weights[e].T``, where ``x_e`` are the next ``tokens_per_group[e]`` rows of ``x`` [T, K]:

- ``weights`` are E tensors [N, K] in ``F.linear`` / Megatron layout (out x in), or one [E, N, K];
- ``tokens_per_group`` is a list of E non-negative ints (or a 1-D integer tensor) summing to T;
  a group may be empty (an expert that got no token) and its weight then gets a zero gradient;
- ``x`` and the weights share one floating dtype; products are accumulated as torch's ``mm`` does
  (fp32 accumulation for bf16/fp16) and rounded once to that dtype, like Megatron's expert linears;
- ``main_grads`` (optional, one tensor or None per weight): Megatron's gradient-accumulation fusion.
  The weight gradient ``g_e^T x_e`` is added into that buffer with fp32 accumulation and one
  rounding (``ops.wgrad_accum``'s contract) and autograd receives a zero gradient for the weight, so
  ``weight.grad + main_grad`` is the same total as without the buffer and accumulation hooks still
  run. Without a buffer the weight's gradient comes back through autograd as usual.

Every backend is the same ``torch.autograd.Function`` (it saves ``x`` and the weights, never an
output) with a different set of kernels for its three products: forward ``x_e W_e^T``, input
gradient ``g_e W_e`` and weight gradient ``g_e^T x_e``.

- eager: one ``@`` per group and ``torch.cat`` of the results: the per-expert loop, the reference.
- fast: the same per-group GEMMs written straight into one preallocated output (``torch.mm(...,
  out=)`` on row slices), so neither pass allocates per-group results or concatenates them.
  torch 2.13 also has ``torch.nn.functional.grouped_mm`` with a CPU kernel (fp32/bf16/fp16, every
  stride a multiple of 16 bytes), but it wants the weights as one [E, K, N] tensor: with Megatron's
  per-expert parameters that is a ``torch.stack`` of every weight in each forward and a split of the
  gradient in each backward. Measured on CPU (figures in docs/features/fused-kernels.md, "Backend
  choices"), in fp32 and bf16: forward only, ``mm`` into one buffer beats per-group results + ``cat``
  and matches ``grouped_mm`` on pre-stacked weights, while stacking the weights in each call makes
  ``grouped_mm`` the slowest of the four; forward + backward with per-expert weights, fast is a little
  faster than eager (the op is GEMM-bound: the gain is the copies saved; the whole expert layer gains
  more, see bench/ops.py). So fast uses the loop for per-expert weights and ``grouped_mm`` only when the
  caller hands one stacked [E, N, K] tensor with 16-byte-aligned strides (see ``_fast_kernels``),
  where it measured clearly faster than eager in both dtypes.
- npu: ``torch_npu.npu_grouped_matmul`` (documented signature ``npu_grouped_matmul(x, weight, *,
  bias=None, ..., group_list=None, split_item=0, group_type=-1, group_list_type=0, ...)`` returning
  a list of tensors): one x tensor split along M by ``group_list`` (counts, ``group_list_type=1``,
  ``group_type=0``) with a single output (``split_item=3``) for the forward and the input gradient,
  and the K-axis grouping (``group_type=2``) of ``g^T`` and ``x`` for the weight gradients. Written
  against torch_npu's documentation and **not verified on Ascend hardware** (none here); any call
  it cannot serve (no torch_npu, not on an NPU, dtype, more than 128 groups) falls back with a notice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyper_adaptor.ops import backend
from hyper_adaptor.ops.backend import Impl, Op, need_npu_tensor, npu_module
from hyper_adaptor.ops.wgrad_accum import wgrad_accum

__all__ = ["grouped_gemm", "grouped_gemm_op"]

_NPU_MAX_GROUPS = 128  # torch_npu documents at most 128 tensors per list
_NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------- arguments
def _counts(tokens_per_group) -> list[int]:
    if isinstance(tokens_per_group, torch.Tensor):
        if tokens_per_group.dim() != 1 or tokens_per_group.is_floating_point():
            raise ValueError("grouped_gemm: tokens_per_group must be a 1-D integer tensor or a list of ints, "
                             f"got a {tokens_per_group.dtype} tensor of shape {tuple(tokens_per_group.shape)}")
        return [int(c) for c in tokens_per_group.tolist()]
    return [int(c) for c in tokens_per_group]


def _weight_list(weights) -> list[torch.Tensor]:
    if isinstance(weights, torch.Tensor):
        if weights.dim() != 3:
            raise ValueError(f"grouped_gemm: stacked weights must be [E, N, K], got {tuple(weights.shape)}")
        return list(weights.unbind(0))
    return list(weights)


def _check(x: torch.Tensor, weights: list[torch.Tensor], counts: list[int], main_grads) -> None:
    if x.dim() != 2:
        raise ValueError(f"grouped_gemm: x must be [tokens, in_features], got shape {tuple(x.shape)}")
    if not weights:
        raise ValueError("grouped_gemm: at least one weight is needed")
    if len(counts) != len(weights):
        raise ValueError(f"grouped_gemm: {len(weights)} weights but {len(counts)} group sizes")
    if any(c < 0 for c in counts) or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_gemm: group sizes {counts} must be >= 0 and sum to the {x.shape[0]} rows of x")
    shape = weights[0].shape
    for w in weights:
        if w.dim() != 2 or w.shape != shape or w.shape[1] != x.shape[1]:
            raise ValueError(f"grouped_gemm: every weight must be [out, {x.shape[1]}] of one shape; "
                             f"got {tuple(w.shape)} (first {tuple(shape)})")
        if w.dtype != x.dtype:
            raise ValueError(f"grouped_gemm: x is {x.dtype} but a weight is {w.dtype}")
    if main_grads is not None:
        if len(main_grads) != len(weights):
            raise ValueError(f"grouped_gemm: {len(main_grads)} main_grads for {len(weights)} weights")
        for buf in main_grads:
            if buf is not None and buf.shape != shape:
                raise ValueError(f"grouped_gemm: a main_grad of shape {tuple(buf.shape)} for weights {tuple(shape)}")


# --------------------------------------------------------------------------------------- kernels
# ``weights`` below is what the caller gave: a list of [N, K] tensors, or one [E, N, K] tensor (whose
# iteration yields the same [N, K] slices).
@dataclass(frozen=True)
class _Kernels:
    """The three products of one backend; ``counts`` are the group sizes."""

    name: str
    forward: Callable  # (x, weights, counts) -> [T, N]
    dgrad: Callable  # (grad, weights, counts, x_shape) -> [T, K]
    wgrad: Callable  # (x, grad, counts) -> E tensors [N, K] (a list, or one [E, N, K] tensor)
    wgrad_accum_backend: str | None  # backend of ops.wgrad_accum for the main_grad buffers


def _eager_forward(x, weights, counts):
    return torch.cat([xe @ w.t() for xe, w in zip(x.split(counts), weights)])


def _eager_dgrad(grad, weights, counts, x_shape):
    return torch.cat([ge @ w for ge, w in zip(grad.split(counts), weights)])


def _eager_wgrad(x, grad, counts):
    return [ge.t() @ xe for xe, ge in zip(x.split(counts), grad.split(counts))]


EAGER = _Kernels("eager", _eager_forward, _eager_dgrad, _eager_wgrad, "eager")


def _loop_forward(x, weights, counts):
    out = x.new_empty(x.shape[0], weights[0].shape[0])
    for xe, oe, w, c in zip(x.split(counts), out.split(counts), weights, counts):
        if c:
            torch.mm(xe, w.t(), out=oe)
    return out


def _loop_dgrad(grad, weights, counts, x_shape):
    out = grad.new_empty(x_shape)
    for ge, oe, w, c in zip(grad.split(counts), out.split(counts), weights, counts):
        if c:
            torch.mm(ge, w, out=oe)
    return out


def _loop_wgrad(x, grad, counts):
    return [torch.mm(ge.t(), xe) for xe, ge in zip(x.split(counts), grad.split(counts))]


LOOP = _Kernels("fast", _loop_forward, _loop_dgrad, _loop_wgrad, "fast")


def _offsets(counts, device):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


# torch's grouped_mm: only for one stacked [E, N, K] weight (see _fast_kernels); the CPU kernel wants
# every stride a multiple of 16 bytes, so the operands are passed as row-major views of that.
def _torch_grouped_forward(x, stacked, counts):
    return F.grouped_mm(x, stacked.transpose(-2, -1), offs=_offsets(counts, x.device))


def _torch_grouped_dgrad(grad, stacked, counts, x_shape):
    return F.grouped_mm(grad, stacked, offs=_offsets(counts, grad.device))


def _torch_grouped_wgrad(x, grad, counts):
    # 2-D x 2-D: the jagged dim (tokens) is the reduced one; g^T as a view keeps a 16-byte stride
    return F.grouped_mm(grad.t(), x, offs=_offsets(counts, x.device))  # [E, N, K]


TORCH_GROUPED = _Kernels("fast", _torch_grouped_forward, _torch_grouped_dgrad, _torch_grouped_wgrad, "fast")


def _npu_forward(x, weights, counts):
    group_list = torch.tensor(counts, dtype=torch.int64, device=x.device)
    return npu_module().npu_grouped_matmul([x], [w.t() for w in weights], group_list=group_list,
                                           split_item=3, group_type=0, group_list_type=1)[0]


def _npu_dgrad(grad, weights, counts, x_shape):
    group_list = torch.tensor(counts, dtype=torch.int64, device=grad.device)
    return npu_module().npu_grouped_matmul([grad], list(weights), group_list=group_list,
                                           split_item=3, group_type=0, group_list_type=1)[0]


def _npu_wgrad(x, grad, counts):
    # K-axis grouping: group e multiplies g_e^T [N, t_e] by x_e [t_e, K]; one [E, N, K] output
    group_list = torch.tensor(counts, dtype=torch.int64, device=x.device)
    out = npu_module().npu_grouped_matmul([grad.t()], [x], group_list=group_list,
                                          split_item=3, group_type=2, group_list_type=1)[0]
    return out.reshape(len(counts), grad.shape[1], x.shape[1])


NPU = _Kernels("npu", _npu_forward, _npu_dgrad, _npu_wgrad, None)


# -------------------------------------------------------------------------------------- autograd
class _GroupedGemmFn(torch.autograd.Function):
    """Inputs: x, then the weights (E tensors, or one stacked [E, N, K] tensor when ``stacked``)."""

    @staticmethod
    def forward(ctx, x, counts, kernels, main_grads, stacked, *weights):
        ctx.counts, ctx.kernels, ctx.main_grads, ctx.stacked = counts, kernels, main_grads, stacked
        ctx.save_for_backward(x, *weights)
        return kernels.forward(x, weights[0] if stacked else weights, counts)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        counts, kernels, main_grads, stacked = ctx.counts, ctx.kernels, ctx.main_grads, ctx.stacked
        grad = grad.contiguous()
        per_expert = weights[0] if stacked else weights
        grad_x = kernels.dgrad(grad, per_expert, counts, x.shape) if ctx.needs_input_grad[0] else None
        groups = len(counts)
        wanted = [any(ctx.needs_input_grad[5:])] * groups if stacked else list(ctx.needs_input_grad[5:])
        if not any(wanted):
            return (grad_x, None, None, None, None, *([None] * len(weights)))
        buffers = main_grads or [None] * groups
        grad_ws = [None] * groups
        if any(buf is None for buf in buffers):
            computed = kernels.wgrad(x, grad, counts)
            if stacked and main_grads is None:
                stacked_grad = computed if isinstance(computed, torch.Tensor) else torch.stack(computed)
                return (grad_x, None, None, None, None, stacked_grad)
            grad_ws = [g if buf is None else None for g, buf in zip(computed, buffers)]
        rows = list(zip(x.split(counts), grad.split(counts)))
        for e, buf in enumerate(buffers):
            if wanted[e] and buf is not None:
                wgrad_accum(rows[e][0], rows[e][1], buf, backend=kernels.wgrad_accum_backend)
                grad_ws[e] = torch.zeros_like(per_expert[e])  # the gradient is in the buffer
        if stacked:
            return (grad_x, None, None, None, None, torch.stack(grad_ws))
        return (grad_x, None, None, None, None, *[g if w else None for g, w in zip(grad_ws, wanted)])


def _run(kernels: _Kernels, x, weights, tokens_per_group, main_grads):
    ws, counts = _weight_list(weights), _counts(tokens_per_group)
    _check(x, ws, counts, main_grads)
    buffers = list(main_grads) if main_grads is not None else None
    if isinstance(weights, torch.Tensor):
        return _GroupedGemmFn.apply(x, counts, kernels, buffers, True, weights)
    return _GroupedGemmFn.apply(x, counts, kernels, buffers, False, *ws)


def _eager(x, weights, tokens_per_group, *, main_grads=None):
    return _run(EAGER, x, weights, tokens_per_group, main_grads)


def _aligned_for_torch_grouped_mm(x, weights) -> bool:
    """One contiguous [E, N, K] weight, a row-major x, every stride a multiple of 16 bytes."""
    if not isinstance(weights, torch.Tensor) or x.device.type not in ("cpu", "cuda"):
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not weights.is_contiguous():
        return False
    size = x.element_size()
    return x.stride(1) == 1 and all((n * size) % 16 == 0 for n in (weights.shape[1], weights.shape[2], x.stride(0)))


def _fast_kernels(x, weights) -> _Kernels:
    # --deterministic-mode on CUDA: torch documents no determinism for grouped_mm's CUTLASS kernels, while
    # cuBLAS's plain GEMMs are deterministic with CUBLAS_WORKSPACE_CONFIG set (NVIDIA's cuBLAS docs,
    # "results reproducibility"); the loop of torch.mm gives the same products, one GEMM per group
    if backend.DETERMINISTIC and x.device.type == "cuda":
        return LOOP
    return TORCH_GROUPED if _aligned_for_torch_grouped_mm(x, weights) else LOOP


def _fast(x, weights, tokens_per_group, *, main_grads=None):
    return _run(_fast_kernels(x, weights), x, weights, tokens_per_group, main_grads)


def _npu(x, weights, tokens_per_group, *, main_grads=None):
    return _run(NPU, x, weights, tokens_per_group, main_grads)


def _npu_supports(x, weights, tokens_per_group, *, main_grads=None):
    ws = _weight_list(weights)
    reason = need_npu_tensor(x, *ws)
    if reason:
        return reason
    if not hasattr(npu_module(), "npu_grouped_matmul"):
        return "this torch_npu has no npu_grouped_matmul"
    if x.dtype not in _NPU_DTYPES:
        return f"dtype {x.dtype}"
    if len(ws) > _NPU_MAX_GROUPS:
        return f"{len(ws)} groups (npu_grouped_matmul takes at most {_NPU_MAX_GROUPS})"
    return None


def _npu_nondeterministic(*_, **__):
    # not found in torch_npu's deterministic-computing API list nor in CANN's list of aclnn APIs the
    # deterministic switch covers (as far as they were read; not run on an NPU here): treated as not
    # deterministic until shown otherwise; the fast backend's torch.mm is on the list
    return "npu_grouped_matmul is not documented as deterministic under torch.use_deterministic_algorithms"


grouped_gemm_op = Op(
    "grouped_gemm",
    npu=Impl(_npu, _npu_supports, _npu_nondeterministic),
    fast=Impl(_fast),
    eager=Impl(_eager),
)


def grouped_gemm(x: torch.Tensor, weights: Sequence[torch.Tensor] | torch.Tensor, tokens_per_group, *,
                 main_grads: Sequence[torch.Tensor | None] | None = None,
                 backend: str | None = None) -> torch.Tensor:
    """``[T, N]``: rows of group e are ``x_e @ weights[e].T`` (see the module doc)."""
    return grouped_gemm_op(x, weights, tokens_per_group, main_grads=main_grads, backend=backend)
