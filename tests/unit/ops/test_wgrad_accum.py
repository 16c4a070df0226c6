"""wgrad_accum (gradient accumulation fusion) against a plain reference, and inside megatron's linears."""

import ast

import pytest
import torch

import hyper_adaptor.megatron_adaptor  # noqa: F401  (level 0 before any megatron import)
from hyper_adaptor.ops import backend as ops_backend
from hyper_adaptor.ops import wgrad_accum as module
from hyper_adaptor.ops.wgrad_accum import KERNELS, WGRAD_ACCUM, wgrad_accum
from tests.unit.ops._world import megatron_world_of_one

# A bf16 x bf16 product is exact in fp32, so bf16 inputs into an fp32 main_grad carry only fp32
# summation error: the same tolerance as fp32 inputs. Rounding the product to bf16 first (the
# mistake this guards against) errs by ~1e-1 on these shapes.
FP32_RTOL, FP32_ATOL = 1e-5, 1e-4
# A half main_grad is rounded once per call: within one bf16 ulp (2**-8 relative) of the exact sum
# of its previous value and the product (2**-7 allows a tie decided differently).
BF16_RTOL, BF16_ATOL = 2 ** -7, 1e-6

SHAPES = [  # (input shape, out features)
    ((1, 3, 37), 19),   # [s, b, h] with s = 1, h not a power of two
    ((5, 2, 48), 33),
    ((7, 13), 11),      # already 2-D
    ((0, 2, 8), 5),     # no tokens: nothing to add
]
BACKENDS = ["eager", "fast", "npu"]  # npu falls back here (no torch_npu)


def reference(pairs, start):
    """start + sum of grad_output^T @ input over (input, grad_output) pairs, in fp64."""
    total = start.double().clone()
    for x, g in pairs:
        total += g.reshape(-1, g.shape[-1]).double().t() @ x.reshape(-1, x.shape[-1]).double()
    return total


def make(shape, out, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(*shape[:-1], out, generator=gen).to(dtype)
    return x, g


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,out", SHAPES)
def test_accumulates_two_calls_into_fp32(backend, in_dtype, shape, out):
    pairs = [make(shape, out, in_dtype, seed) for seed in (1, 2)]
    start = torch.randn(out, shape[-1], generator=torch.Generator().manual_seed(3))
    main_grad = start.clone()
    for x, g in pairs:
        assert wgrad_accum(x, g, main_grad, backend=backend) is main_grad
    assert main_grad.dtype == torch.float32
    torch.testing.assert_close(main_grad.double(), reference(pairs, start), rtol=FP32_RTOL, atol=FP32_ATOL)


@pytest.mark.parametrize("shape,out", SHAPES[:3])
def test_fast_matches_eager(shape, out):
    for in_dtype in (torch.float32, torch.bfloat16):
        x, g = make(shape, out, in_dtype, 4)
        eager, fast = torch.zeros(out, shape[-1]), torch.zeros(out, shape[-1])
        wgrad_accum(x, g, eager, backend="eager")
        wgrad_accum(x, g, fast, backend="fast")
        torch.testing.assert_close(fast, eager, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_bf16_product_is_not_rounded_before_accumulating():
    x, g = make((64, 96), 40, torch.bfloat16, 5)
    exact = reference([(x, g)], torch.zeros(40, 96))
    rounded = (g.t() @ x).double()  # what a bf16 GEMM + add_ would accumulate
    assert (rounded - exact).abs().max() > 10 * FP32_ATOL  # the check below can tell them apart
    for backend in ("eager", "fast"):
        main_grad = torch.zeros(40, 96)
        wgrad_accum(x, g, main_grad, backend=backend)
        torch.testing.assert_close(main_grad.double(), exact, rtol=FP32_RTOL, atol=FP32_ATOL)


@pytest.mark.parametrize("backend", ["eager", "fast"])
def test_half_main_grad_is_rounded_once_per_call(backend):
    main_grad = torch.zeros(10, 24, dtype=torch.bfloat16)
    for seed in (6, 7):
        x, g = make((4, 3, 24), 10, torch.bfloat16, seed)
        expected = reference([(x, g)], main_grad)  # exact sum with the current (rounded) value
        if backend == "fast":
            KERNELS.wgrad_gemm_accum_fp16(x, g, main_grad)
        else:
            wgrad_accum(x, g, main_grad, backend="eager")
        assert main_grad.dtype == torch.bfloat16
        torch.testing.assert_close(main_grad.double(), expected, rtol=BF16_RTOL, atol=BF16_ATOL)


def test_kernels_take_apex_argument_order_and_work_in_place():
    x, g = make((3, 2, 17), 9, torch.bfloat16, 8)
    main_grad = torch.zeros(9, 17)
    assert KERNELS.wgrad_gemm_accum_fp32(x, g, main_grad) is None  # like apex: in place, no result
    torch.testing.assert_close(main_grad.double(), reference([(x, g)], torch.zeros(9, 17)),
                               rtol=FP32_RTOL, atol=FP32_ATOL)


def test_shape_mismatch_is_an_error_naming_shapes():
    x, g = make((4, 6), 5, torch.float32, 9)
    for bad in (torch.zeros(6, 5), torch.zeros(5, 7)):
        with pytest.raises(ValueError, match="main_grad's shape"):
            wgrad_accum(x, g, bad)
    with pytest.raises(ValueError):
        wgrad_accum(x, g[:3], torch.zeros(5, 6))


def test_npu_backend_says_why_it_cannot_serve_here():
    x, g = make((4, 6), 5, torch.bfloat16, 10)
    reason = WGRAD_ACCUM.impls["npu"].supports(x, g, torch.zeros(5, 6))
    assert reason and "torch_npu" in reason
    assert WGRAD_ACCUM.resolve(x, g, torch.zeros(5, 6), backend="npu") == "fast"


def test_ops_module_stays_free_of_megatron_and_cuda():
    source = open(module.__file__).read()
    assert "torch.cuda" not in source
    tree = ast.parse(source)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.split(".")[0] == "megatron" for name in imported)


# ------------------------------------------------ fast backend on CUDA: half GEMM with fp32 output
# No GPU here: FakeTensorMode makes tensors that claim to be on CUDA (shapes, dtypes and devices only,
# no data), so the CUDA decision and the call it leads to run as they would on a GPU. The GPU session
# checks the numbers (tests/gpu/test_cuda_fast_ops.py).


@pytest.fixture
def fake_cuda():
    """A FakeTensorMode; ``fake(mode, shape, dtype, device)`` makes its tensors. (Level 0 maps
    ``device="cuda"`` in factories to the host here, so they are built from meta tensors. Autograd
    must stay off: it would ask this CPU build for a CUDA device guard and abort the process.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        yield mode


def fake(mode, shape, dtype, device):
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device(device))


def _on(mode, device, x_dtype=torch.bfloat16, g_dtype=None, mg_dtype=torch.float32, tokens=6, n_in=8, n_out=5):
    x = fake(mode, (tokens, n_in), x_dtype, device)
    g = fake(mode, (tokens, n_out), g_dtype or x_dtype, device)
    return x, g, fake(mode, (n_out, n_in), mg_dtype, device).zero_()


@pytest.fixture
def out_dtype_mm(monkeypatch):
    """OUT_DTYPE_MM as on a fresh process (restored afterwards), with ``_mm_fp32`` spied on."""
    monkeypatch.setattr(module.OUT_DTYPE_MM, "failed", None)
    monkeypatch.setattr(module.OUT_DTYPE_MM, "calls", 0)
    seen = []
    real = module._mm_fp32

    def spy(a, b):
        seen.append((a.device.type, a.dtype, b.dtype))
        return real(a, b)

    monkeypatch.setattr(module, "_mm_fp32", spy)
    ops_backend._noticed.difference_update({k for k in ops_backend._noticed if k[0] == "wgrad_accum"})
    return seen


def test_this_torch_has_mm_out_dtype():
    # torch 2.13 (this project's pin) has aten::mm.dtype; without it the CUDA path would never be taken
    assert module.OUT_DTYPE_MM.available and module._has_mm_out_dtype()
    assert module.OUT_DTYPE_MM.devices == frozenset({"cuda"})


def test_out_dtype_mm_only_for_cuda_half_inputs_into_fp32(fake_cuda, out_dtype_mm):
    use = module._use_out_dtype_mm
    assert use(*_on(fake_cuda, "cuda", torch.bfloat16)) and use(*_on(fake_cuda, "cuda", torch.float16))
    assert not use(*_on(fake_cuda, "cpu", torch.bfloat16))            # no CPU kernel
    assert not use(*_on(fake_cuda, "meta", torch.bfloat16))           # nor any other device
    assert not use(*_on(fake_cuda, "cuda", torch.float32))            # fp32 inputs: the fp32 GEMM already
    assert not use(*_on(fake_cuda, "cuda", torch.bfloat16, torch.float16))  # mixed half dtypes
    assert not use(*_on(fake_cuda, "cuda", torch.bfloat16, mg_dtype=torch.bfloat16))  # half main_grad
    assert not use(*_on(fake_cuda, "cuda", torch.bfloat16, mg_dtype=torch.float64))   # fp64 keeps fp64 accumulation
    x, g, _ = _on(fake_cuda, "cuda", torch.bfloat16)
    assert x.device.type == "cuda"
    assert not use(x, g, fake(fake_cuda, (5, 8), torch.float32, "cpu"))  # main_grad on another device


def test_out_dtype_mm_not_used_when_unavailable_or_failed(fake_cuda, out_dtype_mm, monkeypatch):
    args = _on(fake_cuda, "cuda", torch.bfloat16)
    assert module._use_out_dtype_mm(*args)
    monkeypatch.setattr(module.OUT_DTYPE_MM, "failed", "RuntimeError: refused")
    assert not module._use_out_dtype_mm(*args)
    monkeypatch.setattr(module.OUT_DTYPE_MM, "failed", None)
    monkeypatch.setattr(module.OUT_DTYPE_MM, "available", False)
    assert not module._use_out_dtype_mm(*args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fast_on_cuda_runs_one_half_gemm_into_fp32(fake_cuda, out_dtype_mm, dtype):
    x = fake(fake_cuda, (3, 2, 8), dtype, "cuda")  # [s, b, h]: flattened to [6, 8]
    g = fake(fake_cuda, (3, 2, 5), dtype, "cuda")
    main_grad = fake(fake_cuda, (5, 8), torch.float32, "cuda").zero_()
    assert wgrad_accum(x, g, main_grad, backend="fast") is main_grad
    assert out_dtype_mm == [("cuda", dtype, dtype)]  # both operands stayed half: no upcast
    assert module.OUT_DTYPE_MM.calls == 1 and module.OUT_DTYPE_MM.failed is None
    assert main_grad.dtype == torch.float32 and main_grad.shape == (5, 8) and main_grad.device.type == "cuda"


def test_fast_on_cuda_keeps_the_upcast_path_outside_the_contract(fake_cuda, out_dtype_mm):
    # fp32 inputs (the upcast path with no casts: fake CUDA tensors cannot be cast on this CPU build;
    # the other cases outside the contract are covered by the decision test above)
    x, g, main_grad = _on(fake_cuda, "cuda", torch.float32)
    assert wgrad_accum(x, g, main_grad, backend="fast") is main_grad
    assert out_dtype_mm == [] and module.OUT_DTYPE_MM.calls == 0


def test_fast_on_cpu_does_not_try_out_dtype_mm(out_dtype_mm):
    x, g = make((4, 3, 24), 10, torch.bfloat16, 13)
    main_grad = torch.zeros(10, 24)
    wgrad_accum(x, g, main_grad, backend="fast")
    assert out_dtype_mm == [] and module.OUT_DTYPE_MM.calls == 0 and module.OUT_DTYPE_MM.failed is None
    torch.testing.assert_close(main_grad.double(), reference([(x, g)], torch.zeros(10, 24)),
                               rtol=FP32_RTOL, atol=FP32_ATOL)


def _cpu_has_no_mm_out_dtype():
    try:
        torch.mm(torch.ones(1, 1, dtype=torch.bfloat16), torch.ones(1, 1, dtype=torch.bfloat16),
                 out_dtype=torch.float32)
    except NotImplementedError:
        return True
    return False


@pytest.mark.parametrize("failure", ["missing kernel", "refused"])
def test_failing_out_dtype_mm_falls_back_once_with_one_notice(out_dtype_mm, monkeypatch, capsys, failure):
    """Tried on CPU, where torch 2.13 has no aten::mm.dtype kernel (a real failure of the op), or
    with the op refusing as cuBLAS might: the call is still right, one notice, never tried again."""
    monkeypatch.setattr(module.OUT_DTYPE_MM, "devices", frozenset({"cpu"}))
    if failure == "missing kernel":
        if not _cpu_has_no_mm_out_dtype():
            pytest.skip("this torch has a CPU kernel for mm with out_dtype")
    else:
        def refuse(a, b):
            out_dtype_mm.append(("refused", a.dtype, b.dtype))
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasGemmEx")

        monkeypatch.setattr(module, "_mm_fp32", refuse)
    pairs = [make((4, 3, 24), 10, torch.bfloat16, seed) for seed in (14, 15)]
    main_grad = torch.zeros(10, 24)
    capsys.readouterr()
    for x, g in pairs:
        wgrad_accum(x, g, main_grad, backend="fast")
    assert len(out_dtype_mm) == 1  # tried once, not retried on the second call
    assert module.OUT_DTYPE_MM.calls == 0 and module.OUT_DTYPE_MM.failed
    expected = "NotImplementedError" if failure == "missing kernel" else "CUBLAS_STATUS_NOT_SUPPORTED"
    assert expected in module.OUT_DTYPE_MM.failed
    lines = [line for line in capsys.readouterr().out.splitlines() if "wgrad_accum" in line]
    assert len(lines) == 1 and "upcast" in lines[0], lines
    torch.testing.assert_close(main_grad.double(), reference(pairs, torch.zeros(10, 24)),
                               rtol=FP32_RTOL, atol=FP32_ATOL)


def test_out_of_memory_in_out_dtype_mm_propagates_and_is_retried(out_dtype_mm, monkeypatch):
    monkeypatch.setattr(module.OUT_DTYPE_MM, "devices", frozenset({"cpu"}))
    monkeypatch.setattr(module, "_mm_fp32", lambda a, b: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")))
    x, g = make((4, 24), 10, torch.bfloat16, 16)
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            wgrad_accum(x, g, torch.zeros(10, 24), backend="fast")
        assert module.OUT_DTYPE_MM.failed is None  # the call's error, not the op's


# ---------------------------------------------------------------- inside megatron's linear layers


@pytest.fixture
def world_of_one():
    with megatron_world_of_one():
        yield


@pytest.fixture
def manager():
    from hyper_adaptor.patch_manager import PatchManager
    from hyper_adaptor.patches.fused import grad_accum

    pm = PatchManager()
    pm.register_all(grad_accum.patches(None))
    yield pm
    pm.undo()


def _config(fusion, dtype):
    from megatron.core import ModelParallelConfig

    return ModelParallelConfig(gradient_accumulation_fusion=fusion, params_dtype=dtype,
                               use_cpu_initialization=True, perform_initialization=True)


def _layer(kind, fusion, dtype):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    init = torch.nn.init.normal_
    if kind == "column":
        return ColumnParallelLinear(24, 40, config=_config(fusion, dtype), init_method=init, bias=True,
                                    gather_output=False)
    return RowParallelLinear(24, 40, config=_config(fusion, dtype), init_method=init, bias=True,
                             input_is_parallel=True, skip_bias_add=False)


def _steps(layer, dtype):
    """Two forward+backward passes; returns the (input, grad_output) of each."""
    pairs = []
    for seed in (11, 12):
        x, g = make((3, 2, 24), 40, dtype, seed)
        x.requires_grad_(True)
        out, _ = layer(x)
        out.backward(g)
        pairs.append((x.detach(), g))
    return pairs


@pytest.mark.parametrize("kind", ["column", "row"])
def test_megatron_linear_accumulates_into_main_grad(world_of_one, manager, kind):
    with manager.applied():
        fused = _layer(kind, True, torch.float32)
        fused.weight.main_grad = torch.zeros(fused.weight.shape, dtype=torch.float32)
        plain = _layer(kind, False, torch.float32)
        plain.load_state_dict(fused.state_dict())
        pairs = _steps(fused, torch.float32)
        _steps(plain, torch.float32)
    assert fused.weight.grad is None  # the weight gradient went to main_grad only
    assert fused.weight.main_grad.abs().sum() > 0
    torch.testing.assert_close(fused.weight.main_grad, plain.weight.grad, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(fused.weight.main_grad.double(), reference(pairs, torch.zeros(40, 24)),
                               rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(fused.bias.grad, plain.bias.grad)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_megatron_bf16_linear_accumulates_exact_products_in_fp32(world_of_one, manager, kind):
    with manager.applied():
        fused = _layer(kind, True, torch.bfloat16)
        fused.weight.main_grad = torch.zeros(fused.weight.shape, dtype=torch.float32)
        pairs = _steps(fused, torch.bfloat16)
    torch.testing.assert_close(fused.weight.main_grad.double(), reference(pairs, torch.zeros(40, 24)),
                               rtol=FP32_RTOL, atol=FP32_ATOL)


def test_without_the_patches_megatron_refuses_or_fails(world_of_one, manager):
    from hyper_adaptor.patches.fused import grad_accum

    if grad_accum.apex_in_use():
        pytest.skip("apex's fused_weight_gradient_mlp_cuda is installed: megatron needs no stand-in")
    import megatron.core.tensor_parallel.layers as layers

    assert not hasattr(layers, "fused_weight_gradient_mlp_cuda") and not layers._grad_accum_fusion_available
    with pytest.raises(RuntimeError, match="gradient_accumulation_fusion"):
        _layer("column", True, torch.float32)
    # RowParallelLinear does not check at construction in 0.19.2: its backward finds no module.
    row = _layer("row", True, torch.float32)
    row.weight.main_grad = torch.zeros(row.weight.shape, dtype=torch.float32)
    with pytest.raises(NameError, match="fused_weight_gradient_mlp_cuda"):
        _steps(row, torch.float32)
    # and the patches leave nothing behind once undone
    with manager.applied():
        assert layers.fused_weight_gradient_mlp_cuda is KERNELS and layers._grad_accum_fusion_available
    assert not hasattr(layers, "fused_weight_gradient_mlp_cuda") and not layers._grad_accum_fusion_available
