"""rms_norm against its eager reference and against megatron-core's local-spec norm (torch.nn.RMSNorm)."""

import pytest
import torch

import hyper_adaptor.megatron_adaptor  # noqa: F401  (level 0 before any megatron import)
from hyper_adaptor.ops import backend as ops_backend
from hyper_adaptor.ops.rms_norm import FusedRMSNorm, rms_norm
from hyper_adaptor.patch_manager import PatchManager
from hyper_adaptor.patches.compat import megatron_core as compat
from hyper_adaptor.patches.fused import rms_norm as fused_rms_norm

# (rtol, atol) per dtype. eager is the same formula as torch's RMSNorm (fp32 math, one rounding),
# so only summation order differs in fp32; bf16 allows about two bf16 ulps (2**-8 each).
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-2)}
SHAPES = [(3, 2, 1000), (1, 1, 1536), (5, 1, 96)]  # [s, b, h]: odd hidden, s = b = 1
FAST_SHAPES = [(3, 2, 1000)]  # one shape: each new one may compile again (seconds)
DTYPES = [torch.float32, torch.bfloat16]


def make(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    return x, w, g


def run(fn, x, w, g):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


def config(normalization="RMSNorm", **extra):
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1, normalization=normalization)
    for key, value in extra.items():
        setattr(cfg, key, value)
    return cfg


def megatron_norm(hidden, eps=1e-5):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm(config(), hidden, eps)


def run_module(module, x, w, g):
    module = module.to(x.dtype)
    with torch.no_grad():
        module.weight.copy_(w)
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(g)
    return y.detach(), x.grad, module.weight.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_eager_matches_megatron_torch_norm(shape, dtype):
    x, w, g = make(shape, dtype)
    norm = megatron_norm(shape[-1])
    assert type(norm) is torch.nn.RMSNorm
    want = run_module(norm, x, w, g)
    got = run(lambda a, b: rms_norm(a, b, 1e-5, backend="eager"), x, w, g)
    close(got, want, dtype)
    # the reference must not be trivially equal to something unnormalised
    assert not torch.allclose(got[0].float(), (x * w).float(), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FAST_SHAPES, ids=str)
def test_fast_matches_eager_and_megatron(shape, dtype):
    x, w, g = make(shape, dtype, seed=1)
    got = run(lambda a, b: rms_norm(a, b, 1e-5, backend="fast"), x, w, g)
    close(got, run(lambda a, b: rms_norm(a, b, 1e-5, backend="eager"), x, w, g), dtype)
    close(got, run_module(megatron_norm(shape[-1]), x, w, g), dtype)


def test_eps_is_used():
    x = torch.full((2, 8), 1e-3)
    w = torch.ones(8)
    # rms = 1e-3: with eps 1e-5 -> 1e-3/sqrt(1e-6+1e-5); with eps 0 -> 1
    torch.testing.assert_close(rms_norm(x, w, 0.0, backend="eager"), torch.ones(2, 8))
    torch.testing.assert_close(rms_norm(x, w, 1e-5, backend="eager"),
                               torch.full((2, 8), 1e-3 / (1.1e-5) ** 0.5))


def test_zero_centered_gamma_module():
    x, w, g = make((2, 3, 40), torch.float32)
    module = FusedRMSNorm(40, 1e-5, zero_centered_gamma=True, backend="eager")
    assert torch.count_nonzero(module.weight) == 0
    torch.testing.assert_close(module(x), rms_norm(x, torch.ones(40), 1e-5, backend="eager"))
    with torch.no_grad():
        module.weight.copy_(w - 1)
    y = module(x)
    y.backward(g)
    ref = run(lambda a, b: rms_norm(a, b, 1e-5, backend="eager"), x, w, g)
    close((y.detach(), module.weight.grad), (ref[0], ref[2]), torch.float32)


def test_unknown_backend_in_env_is_an_error_naming_the_variable(monkeypatch):
    ops_backend.force_backend(None)
    monkeypatch.setenv(ops_backend.BACKEND_ENV, "tpu")
    x, w, _ = make((2, 8), torch.float32)
    with pytest.raises(ValueError, match=ops_backend.BACKEND_ENV):
        rms_norm(x, w)


def test_npu_falls_back_to_fast_with_one_notice(capsys, monkeypatch):
    monkeypatch.setattr(ops_backend, "npu_module", lambda: None)  # as on a machine without torch_npu
    ops_backend._noticed.difference_update({k for k in ops_backend._noticed if k[0] == "rms_norm"})
    x, w, g = make((3, 2, 1000), torch.float32, seed=1)
    capsys.readouterr()
    first = rms_norm(x, w, backend="npu")
    second = rms_norm(x, w, backend="npu")
    lines = [line for line in capsys.readouterr().out.splitlines() if "rms_norm" in line]
    assert len(lines) == 1 and "npu" in lines[0] and "using fast" in lines[0], lines
    torch.testing.assert_close(first, rms_norm(x, w, backend="fast"), rtol=0, atol=0)
    torch.testing.assert_close(second, first, rtol=0, atol=0)


def test_patch_swaps_megatron_rmsnorm_and_undo_restores():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    manager = PatchManager()
    manager.register_all(fused_rms_norm.patches(None))
    x, w, g = make((4, 2, 96), torch.float32, seed=2)
    want = run_module(WrappedTorchNorm(config(), 96, 1e-5), x, w, g)
    manager.apply()
    try:
        norm = WrappedTorchNorm(config(), 96, 1e-5)
        assert isinstance(norm, FusedRMSNorm) and norm.eps == 1e-5
        close(run_module(norm, x, w, g), want, torch.float32)
        assert not getattr(norm.weight, "sequence_parallel", False)
        assert type(WrappedTorchNorm(config("LayerNorm"), 96)) is torch.nn.LayerNorm
        shared = WrappedTorchNorm(config(sequence_parallel=True), 96)
        assert isinstance(shared, FusedRMSNorm) and shared.weight.sequence_parallel is True
        centered = WrappedTorchNorm(config(layernorm_zero_centered_gamma=True), 96)
        assert centered.zero_centered_gamma and torch.count_nonzero(centered.weight) == 0
    finally:
        manager.undo()
    assert type(WrappedTorchNorm(config(), 96)) is torch.nn.RMSNorm


@pytest.mark.parametrize("register_ours_first", [True, False])
def test_composition_with_level0_marks_sequence_parallel(register_ours_first):
    """Both wraps in one manager, in either registration order: ours is outer (after compat)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    ours = fused_rms_norm.patches(None)
    level0 = [p for p in compat.patches("cpu") if p.target == fused_rms_norm.TARGET]
    manager = PatchManager()
    manager.register_all(ours + level0 if register_ours_first else level0 + ours)
    with manager.applied():
        norm = WrappedTorchNorm(config(sequence_parallel=True), 32)
        assert isinstance(norm, FusedRMSNorm) and norm.weight.sequence_parallel is True
        layer = WrappedTorchNorm(config("LayerNorm", sequence_parallel=True), 32)
        assert type(layer) is torch.nn.LayerNorm
        assert all(p.sequence_parallel is True for p in layer.parameters())  # compat still applies
    assert type(WrappedTorchNorm(config(), 32)) is torch.nn.RMSNorm


# ------------------------------------------- fast backend: F.rms_norm on CUDA, compiled reference elsewhere
# No GPU here: FakeTensorMode tensors that claim to be on CUDA (no data) run the CUDA branch of the
# fast backend as it would run on a GPU; tests/gpu/test_cuda_fast_ops.py checks its numbers there.
# (Built from meta tensors, since level 0 maps device="cuda" factories to the host; no autograd on
# them: it would ask this CPU build for a CUDA device guard and abort.)


def _fake(mode, shape, dtype, device):
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device(device))


@pytest.fixture
def spied(monkeypatch):
    """Which kernel the fast backend ran: F.rms_norm calls and compiled-reference calls."""
    import torch.nn.functional as F

    from hyper_adaptor.ops import rms_norm as module

    seen = []

    def fused(x, shape, weight, eps):
        seen.append(("fused", x.device.type, tuple(x.shape), tuple(shape), weight is not None, eps))
        # no numbers from fake tensors (and F.rms_norm's bf16 decomposition makes a host tensor under
        # level 0's device mapping): a result of the right kind is all the caller gets to see
        return torch.empty_like(x)

    def compiled(x, weight, eps):
        seen.append(("compiled", x.device.type, tuple(x.shape), eps))
        return module._reference(x, weight, eps)  # stands in for the compiled reference (no compile here)

    monkeypatch.setattr(F, "rms_norm", fused)
    monkeypatch.setattr(module, "_COMPILED", compiled)
    return seen


def test_fast_kernel_is_fused_only_on_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hyper_adaptor.ops.rms_norm import _fast_kernel_for

    assert _fast_kernel_for(torch.empty(2, 8)) == "compiled"
    assert _fast_kernel_for(torch.empty(2, 8, device="meta")) == "compiled"
    with FakeTensorMode() as mode:
        for dtype in DTYPES:
            assert _fast_kernel_for(_fake(mode, (2, 8), dtype, "cuda")) == "fused"
        assert _fast_kernel_for(_fake(mode, (2, 8), torch.bfloat16, "cpu")) == "compiled"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_on_cuda_runs_torch_fused_rms_norm(spied, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = _fake(mode, (3, 2, 40), dtype, "cuda")
        w = _fake(mode, (40,), dtype, "cuda")
        y = rms_norm(x, w, 1e-6, backend="fast")
        assert y.device.type == "cuda" and y.dtype == dtype and y.shape == (3, 2, 40)
    # F.rms_norm on the input as given (megatron's call exactly), never the compiled reference
    assert spied == [("fused", "cuda", (3, 2, 40), (40,), True, 1e-6)]


def test_fast_on_cpu_keeps_the_compiled_reference(spied):
    x, w, g = make((3, 2, 40), torch.bfloat16, seed=3)
    got = run(lambda a, b: rms_norm(a, b, 1e-6, backend="fast"), x, w, g)
    assert spied == [("compiled", "cpu", (6, 40), 1e-6)]  # on the 2-D view, F.rms_norm not called
    close(got, run(lambda a, b: rms_norm(a, b, 1e-6, backend="eager"), x, w, g), torch.bfloat16)
