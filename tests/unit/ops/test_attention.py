"""hyper_adaptor.ops.attention against its eager reference and megatron-core's DotProductAttention."""

import inspect
import math
import os
import subprocess
import sys

import pytest
import torch

import hyper_adaptor.megatron_adaptor  # noqa: F401  (level 0: megatron runs on CPU)
from hyper_adaptor.ops import attention as attn
from hyper_adaptor.ops import backend as backend_module
from hyper_adaptor.patch_manager import PatchManager
from hyper_adaptor.patches.fused import attention as attn_patch

from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

# (rtol, atol as a fraction of max(1, the reference's largest magnitude)) per dtype. fp32 differs only by
# summation order; bf16 by where probabilities are rounded (eager/megatron round them to bf16 before
# @ v, SDPA keeps fp32 inside) and by bf16 accumulation of GQA key/value grads over heads.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}
# (sq, b, np, ng, hn): head dims 80/96, GQA ratios 1/2/4, a single token
SHAPES = [(16, 2, 4, 4, 80), (12, 2, 4, 2, 96), (9, 1, 8, 2, 64), (1, 2, 4, 1, 80)]


def _inputs(sq, b, np_, ng, hn, dtype, sk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    sk = sq if sk is None else sk
    q = torch.randn(sq, b, np_, hn, generator=g).to(dtype)
    k = torch.randn(sk, b, ng, hn, generator=g).to(dtype)
    v = torch.randn(sk, b, ng, hn, generator=g).to(dtype)
    grad = torch.randn(sq, b, np_ * hn, generator=g).to(dtype)
    return q, k, v, grad


def _padding_mask(b, sq, sk):
    """[b, 1, sq, sk], True = masked: batch i hides its last 2*i keys (never a whole row)."""
    mask = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
    for i in range(b):
        if 2 * i:
            mask[i, :, :, max(1, sk - 2 * i):] = True
    return mask


def _run(fn, q, k, v, grad):
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fn(*xs)
    out.backward(grad)
    return [out.detach()] + [x.grad for x in xs]


def _assert_all_close(got, want, dtype):
    rtol, atol = TOL[dtype]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        scale = max(w.abs().max().item(), 1.0)
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol * scale)


def _megatron_module(np_, ng, hn, dtype, mask_type, layer_number=1, qk_scaling=False, dropout=0.0):
    config = TransformerConfig(
        num_layers=1, hidden_size=np_ * hn, num_attention_heads=np_, num_query_groups=ng, kv_channels=hn,
        attention_dropout=dropout, hidden_dropout=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        masked_softmax_fusion=False, apply_query_key_layer_scaling=qk_scaling)
    return DotProductAttention(config, layer_number=layer_number, attn_mask_type=mask_type, attention_type="self")


# ------------------------------------------------------------------------------------ the op alone
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masking", ["causal", "padding", "causal+padding", "none"])
def test_fast_matches_eager(masking, shape, dtype):
    sq, b, np_, ng, hn = shape
    q, k, v, grad = _inputs(*shape, dtype)
    mask = _padding_mask(b, sq, sq) if "padding" in masking else None
    kw = dict(causal="causal" in masking, mask=mask, scale=0.3)
    want = _run(lambda *x: attn.attention(*x, backend="eager", **kw), q, k, v, grad)
    got = _run(lambda *x: attn.attention(*x, backend="fast", **kw), q, k, v, grad)
    _assert_all_close(got, want, dtype)


@pytest.mark.parametrize("sq,sk", [(1, 7), (3, 8)])
def test_causal_with_fewer_queries_is_bottom_right_aligned(sq, sk):
    q, k, v, grad = _inputs(sq, 2, 4, 2, 80, torch.float32, sk=sk)
    want = _run(lambda *x: attn.attention(*x, causal=True, backend="eager"), q, k, v, grad)
    got = _run(lambda *x: attn.attention(*x, causal=True, backend="fast"), q, k, v, grad)
    _assert_all_close(got, want, torch.float32)
    # the last query sees every key: the same as no mask at all for that row
    free = attn.attention(q, k, v, causal=False, backend="eager")
    torch.testing.assert_close(want[0][-1], free[-1])
    if sq > 1:
        assert not torch.allclose(want[0][0], free[0])


def test_eager_is_the_textbook_formula():
    q, k, v, _ = _inputs(5, 1, 2, 1, 16, torch.float64)
    got = attn.attention(q, k, v, causal=True, scale=0.25, backend="eager")
    for h in range(2):
        s = (q[:, 0, h] @ k[:, 0, 0].T) * 0.25
        s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(got[:, 0, h * 16:(h + 1) * 16], torch.softmax(s, -1) @ v[:, 0, 0])


# --------------------------------------------------------------------------- against megatron itself
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding])
def test_patched_module_matches_megatron(megatron_state, mask_type, shape, dtype):
    sq, b, np_, ng, hn = shape
    module = _megatron_module(np_, ng, hn, dtype, mask_type, layer_number=3, qk_scaling=True)
    assert math.isclose(attn_patch.effective_scale(module), 1 / math.sqrt(hn))
    q, k, v, grad = _inputs(*shape, dtype, seed=5)
    # megatron's causal path builds its own mask from None; a padding call carries one
    mask = None if mask_type == AttnMaskType.causal else _padding_mask(b, sq, sq)
    want = _run(lambda *x: module(*x, mask), q, k, v, grad)

    original = DotProductAttention.forward
    manager = PatchManager()
    manager.register_all(attn_patch.patches(None))
    with manager.applied():
        assert DotProductAttention.forward is not original
        for backend in ("eager", "fast"):
            backend_module.force_backend(backend)
            try:
                got = _run(lambda *x: module(*x, mask), q, k, v, grad)
            finally:
                backend_module.force_backend(None)
            _assert_all_close(got, want, dtype)
    assert DotProductAttention.forward is original


def test_patched_causal_ignores_the_materialised_mask(megatron_state):
    module = _megatron_module(4, 2, 64, torch.float32, AttnMaskType.causal)
    q, k, v, _ = _inputs(8, 2, 4, 2, 64, torch.float32)
    want = module(q, k, v, None)
    manager = PatchManager()
    manager.register_all(attn_patch.patches(None))
    with manager.applied():
        everything_masked = torch.ones(2, 1, 8, 8, dtype=torch.bool)
        torch.testing.assert_close(module(q, k, v, everything_masked), want, rtol=2e-5, atol=2e-5)


def test_patched_falls_back_to_megatron_with_one_notice(megatron_state, capsys):
    module = _megatron_module(4, 4, 64, torch.float32, AttnMaskType.causal)
    q, k, v, _ = _inputs(8, 1, 4, 4, 64, torch.float32)
    manager = PatchManager()
    manager.register_all(attn_patch.patches(None))
    with manager.applied():
        for _ in range(2):
            # megatron's own forward refuses packed sequences: reaching its assert proves the fallback
            with pytest.raises(AssertionError, match="Packed sequence"):
                module(q, k, v, None, packed_seq_params=object())
    printed = capsys.readouterr().out
    assert printed.count("packed sequences") == 1


# ------------------------------------------------------------------------------------------- dropout
def _dropped_fraction(out, sk):
    # q = 0 makes every probability 1/sk; v = one-hot keys copies each probability into the output
    return (out == 0).float().mean().item()


def _dropout_inputs(sk=64, b=2, n=4):
    q = torch.zeros(sk, b, n, sk)
    v = torch.eye(sk).reshape(sk, 1, 1, sk).expand(sk, b, n, sk).contiguous()
    return q, torch.randn(sk, b, n, sk), v


@pytest.mark.parametrize("backend", ["eager", "fast"])
def test_dropout_drops_about_p_and_is_seeded(backend):
    q, k, v = _dropout_inputs()
    run = lambda: attn.attention(q, k, v, causal=False, dropout_p=0.3, backend=backend)  # noqa: E731
    torch.manual_seed(11)
    first = run()
    assert abs(_dropped_fraction(first, 64) - 0.3) < 0.03
    kept = first[first != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / 64 / 0.7))  # survivors rescaled
    torch.manual_seed(11)
    assert torch.equal(run(), first)
    assert not torch.equal(run(), first)


def test_patched_dropout_uses_megatron_rng_tracker(megatron_state):
    module = _megatron_module(4, 4, 64, torch.float32, AttnMaskType.padding, dropout=0.25)
    q, k, v = _dropout_inputs()
    manager = PatchManager()
    manager.register_all(attn_patch.patches(None))
    with manager.applied():
        module.train()
        tensor_parallel.model_parallel_cuda_manual_seed(99)
        torch.manual_seed(0)
        first = module(q, k, v, None)
        assert abs(_dropped_fraction(first, 64) - 0.25) < 0.03
        tensor_parallel.model_parallel_cuda_manual_seed(99)
        torch.manual_seed(1)  # a different default stream: the dropout must not come from it
        assert torch.equal(module(q, k, v, None), first)
        module.eval()
        assert _dropped_fraction(module(q, k, v, None), 64) == 0.0


# -------------------------------------------------------------------------------------------- memory
_MEASURE = """
import sys, torch
from hyper_adaptor.ops.attention import attention

def status(field):  # kB figures from /proc/self/status
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024

s, b, n, d = 4096, 1, 2, 64
q, k, v = (torch.randn(s, b, n, d) for _ in range(3))
with torch.no_grad():
    attention(q[:64], k[:64], v[:64], causal=True, backend=sys.argv[1])  # warm up kernels and pools
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # restart the peak-RSS mark (VmHWM) here, away from the import's peak
    before = status("VmRSS:")
    attention(q, k, v, causal=True, backend=sys.argv[1])
print(status("VmHWM:") - before)
"""


def _peak_growth(backend):
    out = subprocess.run([sys.executable, "-c", _MEASURE, backend], capture_output=True, text=True,
                         timeout=120, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux peak-RSS reset")
def test_fast_causal_never_materialises_the_score_matrix():
    probs_bytes = 1 * 2 * 4096 * 4096 * 4  # b * n * s * s fp32: 128 MiB
    eager, fast = _peak_growth("eager"), _peak_growth("fast")
    print(f"peak RSS growth at s=4096: eager {eager / 2**20:.1f} MiB, fast {fast / 2**20:.1f} MiB")
    assert eager >= probs_bytes  # the reference really holds the s x s probabilities
    assert fast < probs_bytes / 8


def test_mla_head_sizes_level0_and_level1_match_the_textbook_formula(megatron_state):
    """Multi-latent attention builds megatron's local core attention with key/query heads of
    ``k_channels`` and value heads of ``v_channels`` (patches/compat/megatron_core.py makes the local
    module accept them; megatron's own raises TypeError). Level 0 (megatron's forward) and level 1 (this
    op, eager and fast) give the per-head formula softmax(q k^T s + causal) v, context width heads x v."""
    sq, b, heads, hk, hv, scale = 7, 2, 4, 24, 12, 0.3
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, attention_dropout=0.0,
                               hidden_dropout=0.0, masked_softmax_fusion=False)
    module = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                 attention_type="self", softmax_scale=scale, k_channels=hk, v_channels=hv)
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(sq, b, heads, hk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(sq, b, heads, hv, generator=g, dtype=torch.float64)
    want = torch.empty(sq, b, heads * hv, dtype=torch.float64)
    causal = torch.ones(sq, sq, dtype=torch.bool).triu(1)
    for i in range(b):
        for h in range(heads):
            s = (q[:, i, h] @ k[:, i, h].T * scale).masked_fill(causal, float("-inf"))
            want[:, i, h * hv:(h + 1) * hv] = torch.softmax(s, -1) @ v[:, i, h]
    q, k, v, want = (x.float() for x in (q, k, v, want))
    torch.testing.assert_close(module(q, k, v, None), want, rtol=1e-5, atol=1e-5)
    manager = PatchManager()
    manager.register_all(attn_patch.patches(None))
    with manager.applied():
        for backend in ("eager", "fast"):
            backend_module.force_backend(backend)
            try:
                torch.testing.assert_close(module(q, k, v, None), want, rtol=1e-5, atol=1e-5)
            finally:
                backend_module.force_backend(None)
    # without level 0's wrap megatron's local module refuses the sizes
    with pytest.raises(TypeError, match="k_channels"):
        unwrapped = inspect.unwrap(DotProductAttention.__init__)  # below every wrap on it
        unwrapped(DotProductAttention.__new__(DotProductAttention), config, 1, AttnMaskType.causal,
                          "self", k_channels=hk, v_channels=hv)
