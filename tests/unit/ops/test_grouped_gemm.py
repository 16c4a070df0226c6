"""grouped_gemm against a plain per-expert loop, and megatron's SequentialMLP with and without the patch.

Tolerances per dtype, (rtol, atol as a fraction of max(1, the reference's largest magnitude)):
fp32 — the backends run the same per-group GEMMs (or torch's grouped_mm), so only a GEMM's blocking
may reorder a sum: 1e-5. bf16 — every product is accumulated in fp32 and rounded once to bf16; a
different blocking may flip that one rounding: one bf16 ulp, 2**-7 relative (atol the same fraction
of the largest magnitude). fp32 weight gradients accumulated into main_grad from bf16 inputs are
exact products summed in fp32: 1e-5 against an fp64 reference.
"""

import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import hyper_adaptor.megatron_adaptor  # noqa: F401  (level 0: megatron imports on CPU)
from hyper_adaptor.features.base import FeatureConfigError, restore_hidden, taken
from hyper_adaptor.features.moe_grouped_gemm import MoEGroupedGEMM
from hyper_adaptor.ops import backend as ops_backend
from hyper_adaptor.ops import grouped_gemm as gg
from hyper_adaptor.ops.grouped_gemm import grouped_gemm, grouped_gemm_op
from hyper_adaptor.patch_manager import PatchManager
from hyper_adaptor.patches.fused import grouped_gemm as gg_patch

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 ** -7, 2 ** -7)}
DTYPES = [torch.float32, torch.bfloat16]
# (group sizes, in features K, out features N): an empty expert first / in the middle / last, one
# group, odd feature sizes, a group of one token, no token at all
CASES = [
    ([5, 0, 9, 3], 64, 96),
    ([0, 7, 1, 0, 4], 37, 19),
    ([12], 48, 32),
    ([1, 1, 1], 100, 36),
    ([0, 0], 16, 8),
]


def make(counts, k, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(counts)
    x = torch.randn(t, k, generator=gen).to(dtype)
    w = (torch.randn(len(counts), n, k, generator=gen) / k ** 0.5).to(dtype)
    g = torch.randn(t, n, generator=gen).to(dtype)
    return x, w, g


def run(fn, x, w, g, stacked=False):
    """(out, dx, dW [E, N, K]) of ``fn(x, weights)`` with weights as a list (or one stacked tensor)."""
    x = x.clone().requires_grad_()
    if stacked:
        ws = w.clone().requires_grad_()
    else:
        ws = [wi.clone().requires_grad_() for wi in w]
    out = fn(x, ws)
    out.backward(g)
    dw = ws.grad if stacked else torch.stack([wi.grad for wi in ws])
    return out.detach(), x.grad, dw


def per_expert_loop(counts):
    """The obvious reference: F.linear per expert, concatenated (torch's own autograd)."""
    return lambda x, ws: torch.cat([F.linear(xe, w) for xe, w in zip(x.split(counts), ws)])


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * scale)


# ------------------------------------------------------------------------------------ the op alone
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts,k,n", CASES)
@pytest.mark.parametrize("backend", ["eager", "fast", "npu"])  # npu falls back here (no torch_npu)
def test_matches_the_per_expert_loop(backend, counts, k, n, dtype):
    x, w, g = make(counts, k, n, dtype)
    want = run(per_expert_loop(counts), x, w, g)
    close(run(lambda a, ws: grouped_gemm(a, ws, counts, backend=backend), x, w, g), want, dtype)
    # the counts may come as megatron's tokens_per_expert tensor, the weights as one [E, N, K]
    close(run(lambda a, ws: grouped_gemm(a, ws, torch.tensor(counts), backend=backend), x, w, g, stacked=True),
          want, dtype)


def test_fast_picks_torch_grouped_mm_only_for_aligned_stacked_weights():
    x, w, _ = make([3, 5], 64, 32, torch.float32)
    assert gg._fast_kernels(x, w) is gg.TORCH_GROUPED  # [E, N, K], 16-byte strides
    assert gg._fast_kernels(x, list(w)) is gg.LOOP  # per-expert parameters: no stack per call
    x_odd, w_odd, _ = make([3, 5], 37, 19, torch.float32)
    assert gg._fast_kernels(x_odd, w_odd) is gg.LOOP  # grouped_mm's CPU kernel refuses these strides
    assert gg._fast_kernels(x.double(), w.double()) is gg.LOOP  # no fp64 grouped_mm kernel


def test_empty_expert_gets_a_zero_gradient_and_the_others_do_not():
    counts = [4, 0, 6]
    x, w, g = make(counts, 32, 16, torch.float32)
    for backend in ("eager", "fast"):
        _, dx, dw = run(lambda a, ws: grouped_gemm(a, ws, counts, backend=backend), x, w, g)
        assert torch.count_nonzero(dw[1]) == 0
        assert torch.count_nonzero(dw[0]) == dw[0].numel() and torch.count_nonzero(dw[2]) == dw[2].numel()
        assert dx.shape == x.shape


@pytest.mark.parametrize("backend", ["eager", "fast"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_main_grads_receive_the_weight_gradient_in_fp32(backend, dtype):
    counts = [6, 0, 9, 2]
    x, w, g = make(counts, 48, 24, dtype, seed=2)
    start = [torch.randn(24, 48) for _ in counts]  # what earlier micro-batches left there
    buffers = [s.clone() for s in start]
    buffers[3] = None  # an expert without a buffer keeps the ordinary gradient
    _, dx, dw = run(lambda a, ws: grouped_gemm(a, ws, counts, main_grads=buffers, backend=backend), x, w, g)
    exact = [ge.double().t() @ xe.double() for xe, ge in zip(x.split(counts), g.split(counts))]
    for e in range(3):
        torch.testing.assert_close(buffers[e].double(), start[e].double() + exact[e], rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(dw[e]) == 0  # autograd sees zeros: the total is unchanged
    torch.testing.assert_close(dw[3].double(), exact[3], rtol=TOL[dtype][0], atol=TOL[dtype][1] * 8)
    close((dx,), (run(per_expert_loop(counts), x, w, g)[1],), dtype)


@pytest.mark.parametrize(
    "args, message",
    [
        (lambda x, w: (x, list(w), [3, 3]), "sum to the 5 rows"),
        (lambda x, w: (x, list(w), [6, -1]), ">= 0"),
        (lambda x, w: (x, list(w), [5]), "2 weights but 1 group sizes"),
        (lambda x, w: (x.unsqueeze(0), list(w), [2, 3]), r"\[tokens, in_features\]"),
        (lambda x, w: (x, [w[0], w[1].double()], [2, 3]), "is torch.float64"),
        (lambda x, w: (x, [w[0], w[1][:, :4]], [2, 3]), "one shape"),
        (lambda x, w: (x, list(w), torch.tensor([2.0, 3.0])), "integer tensor"),
    ],
)
def test_bad_input_is_an_error_naming_the_problem(args, message):
    x, w, _ = make([2, 3], 8, 4, torch.float32)
    with pytest.raises(ValueError, match=message):
        grouped_gemm(*args(x, w), backend="eager")


def test_npu_falls_back_to_fast_with_one_notice(capsys, monkeypatch):
    monkeypatch.setattr(ops_backend, "npu_module", lambda: None)  # as on a machine without torch_npu
    ops_backend._noticed.difference_update({k for k in ops_backend._noticed if k[0] == "grouped_gemm"})
    counts = [3, 4]
    x, w, _ = make(counts, 16, 8, torch.float32)
    capsys.readouterr()
    before = grouped_gemm_op.calls["fast"]
    first = grouped_gemm(x, list(w), counts, backend="npu")
    grouped_gemm(x, list(w), counts, backend="npu")
    lines = [line for line in capsys.readouterr().out.splitlines() if "grouped_gemm" in line]
    assert len(lines) == 1 and "npu" in lines[0] and "using fast" in lines[0], lines
    assert grouped_gemm_op.calls["fast"] == before + 2
    torch.testing.assert_close(first, grouped_gemm(x, list(w), counts, backend="eager"), rtol=0, atol=0)


# ------------------------------------------------------------------- inside megatron's SequentialMLP
def sequential_mlp(dtype, num_experts=4, glu=True, fusion=True, bias=False, **extra):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=num_experts, moe_ffn_hidden_size=96,
        moe_router_topk=2, gated_linear_unit=glu, activation_func=F.silu if glu else F.gelu,
        add_bias_linear=bias, bias_activation_fusion=fusion, moe_grouped_gemm=True, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, use_cpu_initialization=True, **extra)
    torch.manual_seed(7)
    module = SequentialMLP(num_experts, config,
                           MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                           pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    if bias:
        with torch.no_grad():
            for p in module.parameters():
                if p.dim() == 1:
                    p.normal_()  # megatron starts biases at zero: make them matter
    return module


def experts_run(module, counts, dtype, seed=3):
    """(output, d hidden, d probs, every parameter's gradient) of one forward + backward."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(counts)
    hidden = torch.randn(t, 64, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(t, generator=gen).requires_grad_()
    grad = torch.randn(t, 64, generator=gen).to(dtype)
    module.zero_grad()
    out, out_bias = module(hidden, torch.tensor(counts), probs)
    assert out_bias is None
    out.backward(grad)
    return [out.detach(), hidden.grad, probs.grad] + [p.grad.clone() for p in module.parameters()]


def patched():
    manager = PatchManager()
    manager.register_all(gg_patch.patches(None))
    return manager


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("glu,fusion", [(True, True), (True, False), (False, False)],
                         ids=["swiglu-fused", "swiglu", "gelu"])
def test_patched_sequential_mlp_matches_megatron(megatron_state, glu, fusion, dtype):
    from megatron.core.transformer.moe.experts import SequentialMLP

    module = sequential_mlp(dtype, glu=glu, fusion=fusion)
    counts = [5, 0, 9, 3]  # expert 1 gets no token
    want = experts_run(module, counts, dtype)
    original = SequentialMLP.forward
    before = grouped_gemm_op.calls["fast"]
    with patched().applied():
        assert SequentialMLP.forward is not original
        got = experts_run(module, counts, dtype)
    assert SequentialMLP.forward is original
    assert grouped_gemm_op.calls["fast"] == before + 2  # fc1 and fc2, once each for all experts
    close(got, want, dtype)
    assert torch.count_nonzero(got[3 + 2]) == 0  # expert 1's fc1 weight: no token, zero gradient


def test_patched_experts_with_biases_match_the_formula(megatron_state):
    """megatron's own per-expert path cannot run biased experts in a world of one (its in-place bias
    add on a view raises), so the reference is the formula: fc2(act(fc1 x + b1) p) + b2 p."""
    module = sequential_mlp(torch.float32, glu=False, fusion=False, bias=True)
    counts = [3, 4, 0, 5]

    def formula(hidden, probs):
        outs = []
        for expert, xe, pe in zip(module.local_experts, hidden.split(counts), probs.split(counts)):
            h = F.gelu(F.linear(xe, expert.linear_fc1.weight) + expert.linear_fc1.bias) * pe.unsqueeze(-1)
            outs.append(F.linear(h, expert.linear_fc2.weight) + expert.linear_fc2.bias * pe.unsqueeze(-1))
        return torch.cat(outs)

    with patched().applied():
        got = experts_run(module, counts, torch.float32)

    class Formula(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, hidden, _counts, probs):
            return formula(hidden, probs), None

    want = experts_run(Formula(), counts, torch.float32)
    close(got, want, torch.float32)
    assert torch.count_nonzero(got[3 + 5]) > 0  # fc2 bias of expert 0 has a gradient


def test_gradient_accumulation_fusion_fills_main_grad_like_megatron(megatron_state):
    """bf16 experts with fp32 main_grad: megatron's linears accumulate there (through the kernel the
    grad_accum_fusion feature provides); the grouped path must leave the same main_grads."""
    from hyper_adaptor.patches.fused import grad_accum

    dtype = torch.bfloat16
    module = sequential_mlp(dtype, gradient_accumulation_fusion=False)
    counts = [6, 2, 0, 7]
    weights = [p for p in module.parameters()]
    for p in weights:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    for expert in module.local_experts:
        expert.linear_fc1.gradient_accumulation_fusion = expert.linear_fc2.gradient_accumulation_fusion = True

    def main_grads_after_two_calls():
        for p in weights:
            p.main_grad.zero_()
            p.grad_added_to_main_grad = False
        experts_run(module, counts, dtype, seed=1)
        outs = experts_run(module, counts, dtype, seed=2)
        return outs, [p.main_grad.clone() for p in weights]

    kernels = PatchManager()
    kernels.register_all(grad_accum.patches(None))
    with kernels.applied():
        want_outs, want = main_grads_after_two_calls()
        with patched().applied():
            got_outs, got = main_grads_after_two_calls()
    assert all(p.grad_added_to_main_grad for p in weights)  # DDP will not add the zero grads again
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert any(torch.count_nonzero(g) for g in got)
    close(got_outs[:3], want_outs[:3], dtype)


def test_state_dict_is_megatrons_with_or_without_the_patch(megatron_state):
    module = sequential_mlp(torch.float32)
    keys = list(module.state_dict())
    weights = [k for k in keys if not k.endswith("_extra_state")]
    assert weights == [f"local_experts.{e}.linear_fc{i}.weight" for e in range(4) for i in (1, 2)]
    with patched().applied():
        counts = [2, 2, 2, 2]
        experts_run(module, counts, torch.float32)
        assert list(module.state_dict()) == keys  # nothing registered on the module by the forward


def test_unsupported_config_runs_megatrons_forward_with_one_notice(megatron_state, capsys):
    module = sequential_mlp(torch.float32, moe_apply_probs_on_input=True)
    module.config.moe_router_topk = 1  # what megatron asserts for this option
    counts = [2, 3, 1, 0]
    want = experts_run(module, counts, torch.float32)
    ops_backend._noticed.difference_update({k for k in ops_backend._noticed if k[0] == "moe_grouped_gemm"})
    before = grouped_gemm_op.calls["fast"]
    capsys.readouterr()
    with patched().applied():
        got = experts_run(module, counts, torch.float32)
        experts_run(module, counts, torch.float32)
    lines = [line for line in capsys.readouterr().out.splitlines() if "moe_grouped_gemm" in line]
    assert len(lines) == 1 and "moe_apply_probs_on_input" in lines[0], lines
    assert grouped_gemm_op.calls["fast"] == before
    close(got, want, torch.float32)


# ----------------------------------------------------------------------------------------- feature
def _args(**kw):
    base = dict(transformer_impl="local", optimization_level=1, moe_grouped_gemm=True, num_experts=4)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_feature_needs_experts_and_stands_aside_for_transformer_engine():
    feature = MoEGroupedGEMM()
    with pytest.raises(FeatureConfigError, match="--moe-grouped-gemm needs --num-experts"):
        feature.validate(_args(num_experts=None))
    te = _args(transformer_impl="transformer_engine")
    assert not feature.is_enabled(te)  # megatron's TE grouped experts serve the flag: no error either
    assert feature.status(te) == (False, "--transformer-impl transformer_engine: megatron's own grouped experts")
    assert not feature.is_enabled(_args(optimization_level=0))
    assert not feature.is_enabled(_args(moe_grouped_gemm=False))


def test_feature_hides_the_flag_from_megatrons_check_and_restores_it():
    feature, args = MoEGroupedGEMM(), _args()
    notices = feature.adjust(args)
    assert len(notices) == 1 and "--moe-grouped-gemm" in notices[0]
    assert args.moe_grouped_gemm is False and taken(args) == {"moe_grouped_gemm": True}
    assert feature.is_enabled(args)  # still requested while megatron validates
    restore_hidden(args)
    assert args.moe_grouped_gemm is True


def test_megatron_validate_args_at_level_0_and_level_1():
    """Through megatron.training's own parse_args + validate_args (a fresh process: applying features
    is process-wide). Level 0 on CPU switches the flag off (one notice) before megatron's CUDA
    capability assertion; level 1 validates, applies the patch and leaves the flag set for the model config."""
    code = """
import sys, torch
import hyper_adaptor.megatron_adaptor
from megatron.training.arguments import parse_args, validate_args
from megatron.core.transformer.moe.experts import SequentialMLP
before = SequentialMLP.forward
common = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
          "--max-position-embeddings", "32", "--micro-batch-size", "1", "--num-experts", "4",
          "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--moe-grouped-gemm"]
sys.argv = ["x", *common, "--optimization-level", "0"]
args = parse_args()
try:
    validate_args(args)
    print("LEVEL0 ok", args.moe_grouped_gemm, SequentialMLP.forward is not before)
except AssertionError as e:
    print("LEVEL0 assert:", e)
sys.argv = ["x", *common, "--optimization-level", "1"]
args = parse_args()
validate_args(args)
print("LEVEL1", args.moe_grouped_gemm, SequentialMLP.forward is not before)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LEVEL0 ok False False" in result.stdout
    assert "[hyper_adaptor] --moe-grouped-gemm: True -> False" in result.stdout
    assert "LEVEL1 True True" in result.stdout
