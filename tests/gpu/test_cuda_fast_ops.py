"""The fast backends' CUDA-only paths on a real GPU, which no CPU test can run:

- wgrad_accum: half inputs into an fp32 main_grad via ``torch.mm(..., out_dtype=torch.float32)`` —
  accurate to fp32 against an fp64 reference, really taken, and never rounding the product to half;
- rms_norm: ``F.rms_norm`` on CUDA, bit for bit megatron's ``torch.nn.RMSNorm``, forward and backward.

Both paths were written after the H100 measurements quoted in their modules' docstrings and had not
run on a GPU when this file was written. Skipped on machines without CUDA (CI has none).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HALF = [torch.bfloat16, torch.float16]


# --------------------------------------------------------------------------------------- wgrad_accum
def _wgrad_case(dtype, seed, shape=(256, 2, 384), out=320):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype).cuda()
    g = torch.randn(*shape[:-1], out, generator=gen).to(dtype).cuda()
    start = torch.randn(out, shape[-1], generator=gen).cuda()
    return x, g, start


def _fp64_sum(start, pairs):
    total = start.double().clone()
    for x, g in pairs:
        total += g.reshape(-1, g.shape[-1]).double().t() @ x.reshape(-1, x.shape[-1]).double()
    return total


def _relative_error(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_wgrad_fast_half_into_fp32_uses_out_dtype_mm_and_is_fp32_accurate(dtype):
    from hyper_adaptor.ops.wgrad_accum import OUT_DTYPE_MM, WGRAD_ACCUM, wgrad_accum

    assert OUT_DTYPE_MM.available, "this torch has no aten::mm.dtype"
    calls, fast_calls = OUT_DTYPE_MM.calls, WGRAD_ACCUM.calls["fast"]
    pairs = [_wgrad_case(dtype, seed)[:2] for seed in (1, 2)]
    start = _wgrad_case(dtype, 3)[2]
    main_grad = start.clone()
    for x, g in pairs:
        assert wgrad_accum(x, g, main_grad, backend="fast") is main_grad
    torch.cuda.synchronize()
    assert OUT_DTYPE_MM.failed is None, OUT_DTYPE_MM.failed
    assert OUT_DTYPE_MM.calls == calls + 2 and WGRAD_ACCUM.calls["fast"] == fast_calls + 2
    assert main_grad.dtype == torch.float32 and main_grad.device.type == "cuda"

    exact = _fp64_sum(start, pairs)
    ours = _relative_error(main_grad, exact)
    assert ours < 1e-5, f"relative error {ours:.2e} of the fp32 main_grad"  # well under 1e-3

    # what a half GEMM + add_ would give (each product rounded to half before it is added)
    rounded = start.clone()
    for x, g in pairs:
        rounded.add_(g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))
    theirs = _relative_error(rounded, exact)
    assert ours * 20 < theirs, f"ours {ours:.2e} is not much better than the half-rounded product's {theirs:.2e}"


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_wgrad_fast_out_dtype_matches_the_upcast_path(dtype):
    from hyper_adaptor.ops.wgrad_accum import wgrad_accum

    x, g, start = _wgrad_case(dtype, 4)
    fast, eager = start.clone(), start.clone()
    wgrad_accum(x, g, fast, backend="fast")
    wgrad_accum(x, g, eager, backend="eager")  # upcast + fp32 addmm_: the contract written out
    exact = _fp64_sum(start, [(x, g)])
    assert _relative_error(fast, exact) < 1e-5 and _relative_error(eager, exact) < 1e-5
    torch.testing.assert_close(fast, eager, rtol=1e-5, atol=1e-4)


def test_wgrad_fast_outside_the_contract_keeps_the_upcast_path():
    from hyper_adaptor.ops.wgrad_accum import OUT_DTYPE_MM, wgrad_accum

    calls = OUT_DTYPE_MM.calls
    x, g, start = _wgrad_case(torch.float32, 5)  # fp32 inputs
    main_grad = start.clone()
    wgrad_accum(x, g, main_grad, backend="fast")
    assert _relative_error(main_grad, _fp64_sum(start, [(x, g)])) < 1e-5
    x, g, start = _wgrad_case(torch.bfloat16, 6)  # half main_grad: rounded once per call
    main_grad = start.to(torch.bfloat16)
    exact = _fp64_sum(main_grad, [(x, g)])
    wgrad_accum(x, g, main_grad, backend="fast")
    assert main_grad.dtype == torch.bfloat16
    torch.testing.assert_close(main_grad.double(), exact, rtol=2 ** -7, atol=1e-6)
    assert OUT_DTYPE_MM.calls == calls


# ------------------------------------------------------------------------------------------ rms_norm
@pytest.mark.parametrize("shape", [(64, 2, 1024), (5, 1, 1000)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_fast_on_cuda_is_bitwise_torch_rmsnorm(monkeypatch, dtype, shape):
    from hyper_adaptor.ops import rms_norm as module

    def no_compile(*args):
        raise AssertionError("the fast backend ran the compiled reference on CUDA")

    monkeypatch.setattr(module, "_COMPILED", no_compile)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=gen).to(dtype).cuda()
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype).cuda()
    g = torch.randn(shape, generator=gen).to(dtype).cuda()
    assert module._fast_kernel_for(x) == "fused"

    norm = torch.nn.RMSNorm(shape[-1], eps=1e-5, device="cuda", dtype=dtype)  # megatron's local spec
    with torch.no_grad():
        norm.weight.copy_(w)
    xm = x.clone().requires_grad_()
    ym = norm(xm)
    ym.backward(g)

    fast_calls = module.rms_norm_op.calls["fast"]
    xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
    yo = module.rms_norm(xo, wo, 1e-5, backend="fast")
    yo.backward(g)
    assert module.rms_norm_op.calls["fast"] == fast_calls + 1

    assert yo.dtype == dtype and yo.shape == x.shape
    assert torch.equal(yo, ym), "forward differs from torch.nn.RMSNorm"
    assert torch.equal(xo.grad, xm.grad), "input gradient differs"
    assert torch.equal(wo.grad, norm.weight.grad), "weight gradient differs"
    # and it is a normalisation, not something trivially equal
    assert not torch.allclose(yo.float(), (x * w).float(), atol=1e-2)
