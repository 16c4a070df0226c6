"""hyper_adaptor.ops.attention_lse: the blocks of ring attention (attention_with_lse, attention_lse_backward)
and merge_attention.

Every backend available here (eager, fast = PyTorch's CPU flash kernel) against autograd of the existing
``attention()`` run in float64 on the same inputs, and the lse against logsumexp of float64 scores.

Tolerances, relative to max(1, the reference's largest magnitude):
- fp32: 1e-5 (rtol and atol). The backends differ from the float64 reference by summation order only
  (measured at most 5e-7 on these shapes).
- bf16: 2e-2 for out, dq, dk, dv: one bf16 rounding of each result plus the kernel's bf16
  probabilities before ``@ v`` (measured at most 1e-2). The lse 1e-4 absolute: both backends compute
  it in fp32 from the same bf16 inputs (measured at most 1.4e-5).
"""

import pytest
import torch

from hyper_adaptor.ops import attention as attn
from hyper_adaptor.ops import attention_lse as lse_op
from hyper_adaptor.ops import backend as ops_backend

BACKENDS = ["eager", "fast"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LSE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4}
# (sq, sk, b, np, ng, hn, causal): MHA and GQA 2/4/6, odd lengths and head dims, one query, sq != sk
CASES = [
    (16, 16, 2, 4, 4, 64, True),
    (16, 16, 2, 4, 4, 64, False),
    (7, 7, 2, 4, 2, 24, True),
    (9, 9, 1, 8, 2, 80, True),
    (1, 1, 2, 4, 1, 32, True),
    (7, 12, 2, 6, 1, 40, False),
    (12, 5, 1, 4, 2, 16, False),
]


def _inputs(sq, sk, b, np_, ng, hn, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, np_, hn, generator=g).to(dtype)
    k = torch.randn(sk, b, ng, hn, generator=g).to(dtype)
    v = torch.randn(sk, b, ng, hn, generator=g).to(dtype)
    dout = torch.randn(sq, b, np_, hn, generator=g).to(dtype)
    return q, k, v, dout


def _reference(q, k, v, dout, causal, scale):
    """(out, lse, dq, dk, dv) in float64: autograd of the existing attention(), lse from the scores."""
    xs = [x.double().requires_grad_() for x in (q, k, v)]
    out = attn.attention(*xs, causal=causal, scale=scale, backend="eager")
    out.backward(dout.double().reshape(out.shape))
    sq, sk, groups = q.shape[0], k.shape[0], q.shape[2] // k.shape[2]
    kh = xs[1].detach().permute(1, 2, 0, 3).repeat_interleave(groups, dim=1)
    scores = xs[0].detach().permute(1, 2, 0, 3) @ kh.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(attn.causal_mask(sq, sk), float("-inf"))
    return [out.detach().reshape(q.shape), torch.logsumexp(scores, -1)] + [x.grad for x in xs]


def _close(got, want, tol, what):
    assert got.shape == want.shape, what
    scale = max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_attention_autograd(backend, case, dtype):
    *shape, causal = case
    q, k, v, dout = _inputs(*shape, dtype)
    scale = 0.3
    want = _reference(q, k, v, dout, causal, scale)
    before = dict(lse_op.attention_lse_op.calls)
    out, lse = lse_op.attention_with_lse(q, k, v, causal=causal, scale=scale, backend=backend)
    grads = lse_op.attention_lse_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend=backend)
    assert lse_op.attention_lse_op.calls[backend] == before[backend] + 1  # served by the backend asked for
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (shape[2], shape[3], shape[0])
    assert [g.dtype for g in grads] == [dtype] * 3
    _close(out, want[0], TOL[dtype], "out")
    _close(lse, want[1], LSE_TOL[dtype], "lse")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
        _close(got, ref, TOL[dtype], name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_key_parts_merge_to_the_whole(backend, dtype):
    # the ring's identity in miniature: queries = the second chunk of 5, keys = an earlier chunk (no mask)
    # then their own diagonal block (causal); merged out/lse, and the backward of each part from the
    # merged out/lse, equal the whole (bottom-right causal attention over both chunks)
    c, b, np_, ng, hn = 5, 2, 4, 2, 24
    q, k, v, dout = _inputs(c, 2 * c, b, np_, ng, hn, dtype, seed=3)
    earlier, own = slice(0, c), slice(c, 2 * c)
    out1, lse1 = lse_op.attention_with_lse(q, k[earlier], v[earlier], causal=False, backend=backend)
    out2, lse2 = lse_op.attention_with_lse(q, k[own], v[own], causal=True, backend=backend)
    out, lse = lse_op.merge_attention(out1, lse1, out2, lse2)
    assert out.dtype == lse.dtype == torch.float32
    out = out.to(dtype)
    g1 = lse_op.attention_lse_backward(dout, q, k[earlier], v[earlier], out, lse, causal=False, backend=backend)
    g2 = lse_op.attention_lse_backward(dout, q, k[own], v[own], out, lse, causal=True, backend=backend)
    dq = g1[0].float() + g2[0].float()
    dk, dv = torch.cat([g1[1], g2[1]]), torch.cat([g1[2], g2[2]])

    want = _reference(q, k, v, dout, True, 1 / hn**0.5)
    _close(out, want[0], TOL[dtype], "merged out")
    _close(lse, want[1], LSE_TOL[dtype], "merged lse")
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want[2:]):
        _close(got, ref, TOL[dtype], name)


def test_merge_is_stable_for_large_lse():
    # exp(200) overflows fp32: a merge that exponentiated lse itself would give inf/nan; this one only
    # exponentiates differences <= 0. (1e-4: fp32 holds an lse of 200 to about 1.5e-5.)
    out1, out2 = torch.ones(3, 1, 2, 4), torch.full((3, 1, 2, 4), 3.0)
    log3, log4 = torch.log(torch.tensor(3.0)).item(), torch.log(torch.tensor(4.0)).item()
    lse1, lse2 = torch.full((1, 2, 3), 200.0), torch.full((1, 2, 3), 200.0 + log3)
    out, lse = lse_op.merge_attention(out1, lse1, out2, lse2)
    torch.testing.assert_close(out, torch.full_like(out1, 2.5), rtol=1e-4, atol=1e-4)  # weights 1/4, 3/4
    torch.testing.assert_close(lse, torch.full_like(lse1, 200.0 + log4), rtol=1e-6, atol=1e-4)


def test_causal_block_must_be_diagonal():
    q, k, v, dout = _inputs(4, 6, 1, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="diagonal blocks"):
        lse_op.attention_with_lse(q, k, v, causal=True)
    out, lse = lse_op.attention_with_lse(q, k, v, causal=False)
    with pytest.raises(ValueError, match="diagonal blocks"):
        lse_op.attention_lse_backward(dout, q, k, v, out, lse, causal=True)
    with pytest.raises(ValueError, match="lse"):
        lse_op.attention_lse_backward(dout, q, k, v, out, lse.transpose(1, 2), causal=False)


def test_npu_request_falls_back_with_one_notice(capsys):
    ops_backend._noticed.difference_update({k for k in ops_backend._noticed if k[0] == "attention_with_lse"})
    q, k, v, _ = _inputs(8, 8, 1, 4, 2, 16, torch.bfloat16)
    before = lse_op.attention_lse_op.calls["fast"]
    for _ in range(2):
        lse_op.attention_with_lse(q, k, v, causal=True, backend="npu")
    assert lse_op.attention_lse_op.calls["fast"] == before + 2
    assert capsys.readouterr().out.count("attention_with_lse: the npu backend cannot serve") == 1


# ------------------------------------------------------------------------------------- attention dropout
def _dropped_reference(q, k, v, dout, keep, p, hidden, scale):
    """(out, dq, dk, dv) in float64: autograd of softmax(scores) * keep / (1 - p) @ v, kv heads repeated;
    ``hidden`` ([sq, sk] bool or None) are the scores masked before the softmax."""
    xs = [x.double().requires_grad_() for x in (q, k, v)]
    groups = q.shape[2] // k.shape[2]
    qh, kh, vh = (x.permute(1, 2, 0, 3) for x in xs)
    kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
    scores = qh @ kh.transpose(-1, -2) * scale
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    out = ((torch.softmax(scores, -1) * keep / (1 - p)) @ vh).permute(2, 0, 1, 3)
    out.backward(dout.double())
    return [out.detach()] + [x.grad for x in xs]


def _keep(seed, sq, sk, b, np_, q_start=0, k_start=0, p=0.3):
    from hyper_adaptor.parallel.context import Dropout

    spec = Dropout(p, torch.tensor(seed))
    return spec.keep(torch.arange(q_start, q_start + sq), torch.arange(k_start, k_start + sk), b, np_)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_block_matches_dense_reference_with_the_same_mask(backend, case):
    *shape, causal = case
    sq, sk, b, np_, _, _ = shape
    q, k, v, dout = _inputs(*shape, torch.float32)
    p, scale = 0.3, 0.3
    keep = _keep(7, sq, sk, b, np_, p=p)
    before = lse_op.attention_lse_op.calls["eager"]
    out, lse = lse_op.attention_with_lse(q, k, v, causal=causal, scale=scale, backend=backend, keep=keep,
                                         dropout_p=p)
    grads = lse_op.attention_lse_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend=backend,
                                          keep=keep, dropout_p=p)
    # the fused kernels cannot take a given mask: a dropout call is served by eager, whatever was asked
    assert lse_op.attention_lse_op.calls["eager"] == before + 1
    want = _dropped_reference(q, k, v, dout, keep, p, attn.causal_mask(sq, sk) if causal else None, scale)
    _close(out, want[0], TOL[torch.float32], "out")
    # the lse stays the unmasked one (merging needs it)
    _close(lse, _reference(q, k, v, dout, causal, scale)[1], LSE_TOL[torch.float32], "lse")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want[1:]):
        _close(got, ref, TOL[torch.float32], name)
    # and the comparison can fail: without the mask the same call is not the dropped attention
    plain, _ = lse_op.attention_with_lse(q, k, v, causal=causal, scale=scale, backend=backend)
    assert (plain - want[0]).abs().max() > 1e-2


def test_dropout_blocks_merge_to_dropout_on_the_global_softmax():
    # two key parts with their own slices of one mask, merged by lse, equal dense dropout over all keys
    c, b, np_, ng, hn, p = 6, 2, 4, 2, 16, 0.25
    q, k, v, dout = _inputs(c, 2 * c, b, np_, ng, hn, torch.float32, seed=5)
    earlier, own = slice(0, c), slice(c, 2 * c)
    keep = _keep(11, c, 2 * c, b, np_, q_start=c, p=p)  # the queries are global rows c..2c-1
    drop = [dict(keep=keep[..., part].contiguous(), dropout_p=p) for part in (earlier, own)]
    out1, lse1 = lse_op.attention_with_lse(q, k[earlier], v[earlier], causal=False, **drop[0])
    out2, lse2 = lse_op.attention_with_lse(q, k[own], v[own], causal=True, **drop[1])
    out, lse = lse_op.merge_attention(out1, lse1, out2, lse2)
    g1 = lse_op.attention_lse_backward(dout, q, k[earlier], v[earlier], out, lse, causal=False, **drop[0])
    g2 = lse_op.attention_lse_backward(dout, q, k[own], v[own], out, lse, causal=True, **drop[1])
    hidden = torch.zeros(c, 2 * c, dtype=torch.bool)
    hidden[:, c:] = attn.causal_mask(c, c)  # bottom-right causal over both parts
    want = _dropped_reference(q, k, v, dout, keep, p, hidden, 1 / hn**0.5)
    _close(out, want[0], TOL[torch.float32], "merged out")
    got = (g1[0] + g2[0], torch.cat([g1[1], g2[1]]), torch.cat([g1[2], g2[2]]))
    for name, grad, ref in zip(("dq", "dk", "dv"), got, want[1:]):
        _close(grad, ref, TOL[torch.float32], name)


def test_dropout_mask_is_a_function_of_seed_and_global_position():
    keep = _keep(3, 64, 64, 2, 4)
    assert abs(1 - keep.float().mean().item() - 0.3) < 0.02  # ~p of the entries dropped
    assert torch.equal(keep, _keep(3, 64, 64, 2, 4))  # regenerated, not stored: same seed, same mask
    assert (keep != _keep(4, 64, 64, 2, 4)).float().mean() > 0.3  # another seed, another mask
    # any cut (rows, keys, heads) is the same cut of the one mask
    assert torch.equal(_keep(3, 16, 8, 2, 4, q_start=40, k_start=8), keep[..., 40:56, 8:16])
    from hyper_adaptor.parallel.context import Dropout

    spec = Dropout(0.3, torch.tensor(3), head_offset=2)
    assert torch.equal(spec.keep(torch.arange(64), torch.arange(64), 2, 2), keep[:, 2:])
    # heads, rows and keys each get their own mask (no coordinate ignored)
    assert not torch.equal(keep[:, 0], keep[:, 1]) and not torch.equal(keep[0], keep[1])
    assert not torch.equal(keep[..., :32, :], keep[..., 32:, :]) and not torch.equal(keep[..., :32], keep[..., 32:])


def test_dropout_arguments_are_checked():
    q, k, v, _ = _inputs(4, 4, 1, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="keep mask"):
        lse_op.attention_with_lse(q, k, v, causal=True, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"keep must be a bool mask \(1, 2, 4, 4\)"):
        lse_op.attention_with_lse(q, k, v, causal=True, keep=torch.ones(1, 2, 4, 3, dtype=torch.bool), dropout_p=0.1)
