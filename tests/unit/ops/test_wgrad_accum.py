"""wgrad_accum (gradient accumulation fusion) against a plain reference, and inside megatron's linears."""

import ast
import os


import pytest
import torch

import hyper_adaptor.megatron_adaptor  # noqa: F401  (level 0 before any megatron import)
from hyper_adaptor.ops import wgrad_accum as module
from hyper_adaptor.ops.wgrad_accum import KERNELS, WGRAD_ACCUM, wgrad_accum
from tests.unit.ops._world import open_world_of_one

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


# ---------------------------------------------------------------- inside megatron's linear layers


@pytest.fixture
def world_of_one():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    created = open_world_of_one()
    owned = not ps.model_parallel_is_initialized()
    if owned:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        yield
    finally:
        if owned:
            ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


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
