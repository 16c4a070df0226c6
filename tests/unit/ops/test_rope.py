"""hyper_adaptor.ops.rope against its eager reference and megatron-core's own unfused RoPE."""

import types

import pytest
import torch

import hyper_adaptor.megatron_adaptor  # noqa: F401  (level 0: megatron imports on CPU)
from hyper_adaptor.ops import rope
from hyper_adaptor.patch_manager import PatchManager
from hyper_adaptor.patches.fused import rope as rope_patch

from megatron.core.models.common.embeddings import rope_utils

# (rtol, atol) per dtype. fp32: the fused function reorders a few roundings; bf16: one bf16 ulp at |x|~4.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 3e-2)}
# (s, b, n, d, rot_dim): odd head dims, a single token, partial rotary
SHAPES = [(7, 2, 3, 80, 80), (1, 1, 2, 96, 96), (5, 2, 4, 128, 64), (6, 1, 2, 96, 32)]


def _inputs(shape, dtype, seed=0, batch_freqs=False):
    s, b, n, d, rot = shape
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(s, b, n, d, generator=g).to(dtype)
    freqs = torch.rand(s, b if batch_freqs else 1, 1, rot, generator=g) * 6.0
    grad = torch.randn(s, b, n, d, generator=g).to(dtype)
    return t, freqs, grad


def _run(fn, t, grad):
    x = t.clone().requires_grad_()
    out = fn(x)
    out.backward(grad)
    return out.detach(), x.grad


def _megatron(t, freqs, interleaved, mla, mscale):
    return lambda x: rope_utils._apply_rotary_pos_emb_bshd(
        x, freqs, rotary_interleaved=interleaved, mla_rotary_interleaved=mla, mscale=mscale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("interleaved,mla", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("backend", ["eager", "fast"])
def test_matches_megatron_forward_and_backward(backend, interleaved, mla, shape, dtype):
    t, freqs, grad = _inputs(shape, dtype)
    mscale = 0.75 if mla else 1.0
    want = _run(_megatron(t, freqs, interleaved, mla, mscale), t, grad)
    got = _run(lambda x: rope.apply_rotary(x, freqs, interleaved=interleaved, mla_interleaved=mla,
                                           mscale=mscale, backend=backend), t, grad)
    rtol, atol = TOL[dtype]
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


@pytest.mark.parametrize("interleaved,mla,function", [(False, False, "_CompiledRotaryFnBackward"),
                                                      (True, False, "_RotaryFnBackward"),
                                                      (False, True, "_RotaryFnBackward")])
def test_fast_fp32_uses_the_fused_function_and_matches_eager(interleaved, mla, function):
    t, freqs, grad = _inputs((9, 2, 3, 96, 64), torch.float32, seed=1, batch_freqs=True)
    assert rope.rope_op.resolve(t, freqs, interleaved=interleaved, mla_interleaved=mla) == "fast"
    x = t.clone().requires_grad_()
    out = rope.apply_rotary(x, freqs, interleaved=interleaved, mla_interleaved=mla, backend="fast")
    # rotate-half pairs: the compiled single-pass function; interleaved / MLA: the hand-written one
    assert type(out.grad_fn).__name__ == function
    out.backward(grad)
    want = _run(lambda y: rope.apply_rotary(y, freqs, interleaved=interleaved, mla_interleaved=mla,
                                            backend="eager"), t, grad)
    torch.testing.assert_close(out.detach(), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, want[1], rtol=1e-5, atol=1e-5)
    # the pass-through channels are untouched, the rotated ones are not
    assert torch.equal(out[..., 64:], t[..., 64:]) and not torch.allclose(out[..., :64], t[..., :64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_rotate_half_is_compiled_saves_only_cos_sin_and_matches_eager(dtype):
    t, freqs, grad = _inputs((8, 2, 4, 128, 128), dtype, seed=4)
    x = t.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda v: saved.append(v) or v, lambda v: v):
        out = rope.apply_rotary(x, freqs, mscale=0.9, backend="fast")
    assert type(out.grad_fn).__name__ == "_CompiledRotaryFnBackward"
    assert sum(v.numel() for v in saved) == 2 * freqs.numel()  # cos and sin, never an activation
    out.backward(grad)
    want = _run(lambda y: rope.apply_rotary(y, freqs, mscale=0.9, backend="eager"), t, grad)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.detach(), want[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(x.grad, want[1], rtol=rtol, atol=atol)


def test_cos_sin_are_reused_for_the_same_angles_and_recomputed_when_they_change():
    t, freqs, _ = _inputs((6, 1, 2, 64, 64), torch.float32, seed=5)
    first = rope._cached_cos_sin(freqs, torch.float32, 1.0)
    assert rope._cached_cos_sin(freqs, torch.float32, 1.0)[0] is first[0]  # the next layer's q, k
    assert rope._cached_cos_sin(freqs, torch.float32, 0.5)[0] is not first[0]  # another mscale
    freqs.mul_(2.0)  # changed in place: the version counter moves, the cache must not answer
    torch.testing.assert_close(rope.apply_rotary(t, freqs, backend="fast"),
                               rope.apply_rotary(t, freqs, backend="eager"), rtol=1e-5, atol=1e-5)
    copy = freqs.clone()  # equal values, another tensor: computed, not matched by value or address
    assert rope._cached_cos_sin(copy, torch.float32, 1.0)[0] is not rope._cached_cos_sin(freqs, torch.float32, 1.0)[0]


def test_compile_failure_falls_back_to_the_uncompiled_function_with_one_notice(monkeypatch, capsys):
    from hyper_adaptor.ops import backend as ops_backend

    def broken():
        def fail(*a, **k):
            from torch._inductor.exc import InvalidCxxCompiler

            raise InvalidCxxCompiler()
        return fail

    monkeypatch.setattr(rope._MATH, "compiled", broken)
    monkeypatch.setattr(rope._MATH, "failed", False)
    ops_backend._noticed.difference_update({k for k in ops_backend._noticed if k[0] == "rope"})
    t, freqs, grad = _inputs((5, 2, 2, 96, 64), torch.float32, seed=6)
    capsys.readouterr()
    got = [_run(lambda y: rope.apply_rotary(y, freqs, backend="fast"), t, grad) for _ in range(2)]
    lines = [line for line in capsys.readouterr().out.splitlines() if "rope" in line]
    assert len(lines) == 1 and "torch.compile failed: InvalidCxxCompiler" in lines[0], lines
    want = _run(lambda y: rope.apply_rotary(y, freqs, backend="eager"), t, grad)
    for g in got:
        torch.testing.assert_close(g[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g[1], want[1], rtol=1e-5, atol=1e-5)


def test_fast_falls_back_when_the_angles_need_grad():
    t, freqs, _ = _inputs((4, 1, 2, 80, 80), torch.float32)
    assert rope.rope_op.resolve(t, freqs.requires_grad_(), backend="fast") == "eager"


def _config(interleaved):
    return types.SimpleNamespace(rotary_interleaved=interleaved, multi_latent_attention=False,
                                 apply_rope_fusion=False, mrope_section=None)


class _OneRank:
    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.mark.parametrize("interleaved", [False, True])
def test_patch_routes_bshd_to_the_op_and_thd_to_megatron_and_undoes(interleaved, monkeypatch):
    original = rope_utils.apply_rotary_pos_emb
    import megatron.core.transformer.attention as attention_module

    assert attention_module.apply_rotary_pos_emb is original
    t, freqs, grad = _inputs((6, 2, 2, 96, 64), torch.float32, seed=3)
    config, group = _config(interleaved), _OneRank()
    want = _run(lambda x: original(x, freqs, config, mscale=0.5, cp_group=group), t, grad)
    packed = t[:, 0]  # [t, h, d] with cu_seqlens
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    want_thd = original(packed, freqs, config, cu_seqlens=cu, cp_group=group)

    manager = PatchManager()
    manager.register_all(rope_patch.patches(None))
    manager.apply()
    try:
        patched = rope_utils.apply_rotary_pos_emb
        assert patched is not original and attention_module.apply_rotary_pos_emb is patched
        calls = []
        monkeypatch.setattr(rope_patch, "apply_rotary",
                            lambda *a, **k: (calls.append(k), rope.apply_rotary(*a, **k))[1])
        got = _run(lambda x: patched(x, freqs, config, mscale=0.5, cp_group=group), t, grad)
        assert [c["interleaved"] for c in calls] == [interleaved] and calls[0]["mscale"] == 0.5
        got_thd = patched(packed, freqs, config, cu_seqlens=cu, cp_group=group)
        assert len(calls) == 1  # packed input stayed with megatron
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_thd, want_thd)
    finally:
        manager.undo()
    assert rope_utils.apply_rotary_pos_emb is original
    assert attention_module.apply_rotary_pos_emb is original
