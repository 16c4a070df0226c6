"""swiglu / bias_swiglu against the eager function, megatron's unfused GLU and its bias_swiglu_impl."""

import pytest
import torch
import torch.nn.functional as F

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor.ops import backend as ops_backend
from hyper_adaptor.ops.swiglu import bias_swiglu, swiglu
from hyper_adaptor.patch_manager import PatchManager
from hyper_adaptor.patches.fused import swiglu as fused_swiglu

# (rtol, atol) per dtype: fp32 differs only in rounding order; bf16 here rounds once where
# megatron's unfused path rounds twice (after SiLU and after the product): about two bf16 ulps.
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-2)}
SHAPES = [(3, 2, 2 * 1000), (1, 1, 2 * 768), (5, 1, 2 * 48)]  # [s, b, 2h]: odd h, s = b = 1
DTYPES = [torch.float32, torch.bfloat16]


def megatron_original():
    """megatron's bias_swiglu_impl as installed (unpatched, whatever the adaptor applied)."""
    from megatron.core.fusions import fused_bias_swiglu

    try:
        return adaptor_module.ADAPTOR.manager.original(fused_swiglu.TARGET)
    except KeyError:
        return fused_bias_swiglu.bias_swiglu_impl


def megatron_unfused_glu(x, bias):
    """The MLP's path with bias_activation_fusion off: add the bias, chunk, silu(first) * second."""
    if bias is not None:
        x = x + bias
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    return F.silu(x_glu) * x_linear


def make(shape, dtype, with_bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(shape, generator=gen)).to(dtype)
    bias = torch.randn(shape[-1], generator=gen).to(dtype) if with_bias else None
    g = torch.randn(shape[:-1] + (shape[-1] // 2,), generator=gen).to(dtype)
    return x, bias, g


def run(fn, x, bias, g):
    x = x.clone().requires_grad_()
    bias = bias.clone().requires_grad_() if bias is not None else None
    y = fn(x, bias)
    y.backward(g)
    return (y.detach(), x.grad) + ((bias.grad,) if bias is not None else ())


# The bias gradient sums one term per token; each term may differ by the per-element bf16 error
# above, so its bound is that relative error times the sum of the terms' magnitudes.
BIAS_GRAD_REL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6}


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    assert len(got) == len(want)
    for a, b in zip(got[:2], want[:2]):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)
    if len(got) == 3:  # bias gradient
        a, b = got[2].float(), want[2].float()
        assert got[2].dtype == want[2].dtype and a.shape == b.shape
        terms = want[1].float().abs().reshape(-1, b.shape[-1]).sum(0)
        bound = BIAS_GRAD_REL[dtype] * terms + atol
        assert torch.all((a - b).abs() <= bound), ((a - b).abs() - bound).max()
        assert torch.allclose(a, want[1].float().reshape(-1, b.shape[-1]).sum(0), rtol=0.05, atol=0.1)


def op(backend):
    return lambda x, bias: bias_swiglu(x, bias, backend=backend)


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_eager_matches_megatron_unfused(shape, dtype, with_bias):
    x, bias, g = make(shape, dtype, with_bias)
    got = run(op("eager"), x, bias, g)
    close(got, run(megatron_unfused_glu, x, bias, g), dtype)
    # the halves are not interchangeable: swapping them must give a different answer
    swapped = torch.cat(torch.chunk(x, 2, -1)[::-1], -1)
    assert not torch.allclose(swiglu(swapped, backend="eager").float(), got[0].float(), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_matches_eager_and_megatron_unfused(dtype):
    shape = (3, 2, 2 * 1000)
    for with_bias in (False, True):  # one compiled graph serves both
        x, bias, g = make(shape, dtype, with_bias, seed=1)
        got = run(op("fast"), x, bias, g)
        close(got, run(op("eager"), x, bias, g), dtype)
        close(got, run(megatron_unfused_glu, x, bias, g), dtype)


def test_matches_megatron_fused_bias_swiglu_impl():
    """megatron's own fused function (torch.compile'd on this torch; bf16 only, to bound compile time)."""
    dtype = torch.bfloat16
    x, bias, g = make((3, 2, 2 * 1000), dtype, True, seed=1)
    want = run(megatron_original(), x, bias, g)
    close(run(op("fast"), x, bias, g), want, dtype)
    close(run(op("eager"), x, bias, g), want, dtype)


def test_saves_only_the_input():
    x, bias, _ = make((4, 2, 64), torch.float32, True)
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        bias_swiglu(x, bias, backend="eager")
    assert sum(t.numel() for t in saved) == x.numel() + bias.numel()  # no [.., h] intermediate


def test_fp8_input_store_stays_close():
    x, bias, g = make((4, 2, 64), torch.bfloat16, True)
    fn = lambda a, b: bias_swiglu(a, b, backend="eager", fp8_input_store=True)  # noqa: E731
    got, want = run(fn, x, bias, g), run(op("eager"), x, bias, g)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # forward uses the full input
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=0.15, atol=0.15)


def test_odd_last_dim_is_refused():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(2, 7), backend="eager")


def test_unknown_backend_in_env_is_an_error_naming_the_variable(monkeypatch):
    ops_backend.force_backend(None)
    monkeypatch.setenv(ops_backend.BACKEND_ENV, "gpu2")
    with pytest.raises(ValueError, match=ops_backend.BACKEND_ENV):
        swiglu(torch.randn(2, 8))


def test_npu_falls_back_to_fast_with_one_notice(capsys, monkeypatch):
    monkeypatch.setattr(ops_backend, "npu_module", lambda: None)  # as on a machine without torch_npu
    ops_backend._noticed.difference_update({k for k in ops_backend._noticed if k[0] == "swiglu"})
    x, bias, _ = make((3, 2, 2 * 1000), torch.float32, True, seed=1)
    capsys.readouterr()
    first = bias_swiglu(x, bias, backend="npu")
    second = bias_swiglu(x, bias, backend="npu")
    lines = [line for line in capsys.readouterr().out.splitlines() if "swiglu" in line]
    assert len(lines) == 1 and "npu" in lines[0] and "using fast" in lines[0], lines
    torch.testing.assert_close(first, bias_swiglu(x, bias, backend="fast"), rtol=0, atol=0)
    torch.testing.assert_close(second, first, rtol=0, atol=0)


def test_patch_replaces_megatron_bias_swiglu_impl_and_undo_restores(monkeypatch):
    ops_backend.force_backend(None)
    monkeypatch.setenv(ops_backend.BACKEND_ENV, "eager")  # no compilation for this shape
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp

    before = fused_bias_swiglu.bias_swiglu_impl
    assert mlp.bias_swiglu_impl is before
    manager = PatchManager()
    manager.register_all(fused_swiglu.patches(None))
    x, bias, g = make((5, 1, 2 * 48), torch.float32, True, seed=3)
    with manager.applied():
        assert fused_bias_swiglu.bias_swiglu_impl is fused_swiglu.bias_swiglu_impl
        assert mlp.bias_swiglu_impl is fused_swiglu.bias_swiglu_impl  # rebound where imported by value
        for b in (bias, None):
            got = run(lambda a, c: mlp.bias_swiglu_impl(a, c, False, False), x, b, g)
            close(got, run(megatron_unfused_glu, x, b, g), torch.float32)
        flat = mlp.bias_swiglu_impl(x.view(5, -1), bias)
        assert flat.shape == (5, 48)
    assert fused_bias_swiglu.bias_swiglu_impl is before and mlp.bias_swiglu_impl is before
