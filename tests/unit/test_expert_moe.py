"""The one-process ``MoE`` block and ``GroupedExperts`` against per-token / per-expert loops (the
reference the distributed engine tests are held to must itself be right), the aux loss, and the
errors bad input gets from the block and the styles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyper_adaptor.parallel.expert import ExpertParallel, ExpertTensorParallel, GroupedExperts, MoE

H, FFN, E, K = 6, 10, 5, 2


def ffn(x, gate, up, down, activation):
    if activation == "swiglu":
        return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
    return F.gelu(x @ up.t()) @ down.t()


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_experts_match_a_loop_over_experts(activation):
    torch.manual_seed(0)
    experts = GroupedExperts(3, H, FFN, activation)
    x = torch.randn(9, H)
    counts = [4, 0, 5]
    out = experts(x, counts)
    gate = experts.w_gate if activation == "swiglu" else [None] * 3
    want = torch.cat([ffn(xe, gate[e], experts.w_up[e], experts.w_down[e], activation)
                      for e, xe in enumerate(x.split(counts))])
    assert torch.allclose(out, want, atol=1e-6)
    out.sum().backward()
    assert not experts.w_up.grad[1].any()          # an expert with no rows gets a zero gradient
    assert list(experts.projections()) == (["w_gate", "w_up", "w_down"] if activation == "swiglu"
                                           else ["w_up", "w_down"])


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [None, 7])
def test_moe_matches_a_per_token_loop(score, shared):
    torch.manual_seed(1)
    moe = MoE(H, FFN, E, K, shared_ffn=shared, score_function=score)
    x = torch.randn(2, 4, H)
    out = moe(x)
    tokens = x.reshape(-1, H)
    ex = moe.experts
    for t, token in enumerate(tokens):
        logits = moe.router.weight @ token
        scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
        top, chosen = scores.topk(K)
        if score == "sigmoid":
            top = top / top.sum()
        want = sum(p * ffn(token[None], ex.w_gate[e], ex.w_up[e], ex.w_down[e], "swiglu")[0]
                   for p, e in zip(top, chosen.tolist()))
        if shared:
            s = moe.shared_expert
            want = want + ffn(token[None], s.gate.weight, s.up.weight, s.down.weight, "swiglu")[0]
        assert torch.allclose(out.reshape(-1, H)[t], want, atol=1e-5), t


def test_aux_loss_is_stored_and_returned():
    torch.manual_seed(2)
    moe = MoE(H, FFN, E, K, aux_loss_coeff=0.1)
    x = torch.randn(12, H)
    out, aux = moe(x, return_aux_loss=True)
    assert aux is moe.aux_loss
    scores = moe.router(x).softmax(-1)
    chosen = scores.topk(K, dim=-1).indices
    fraction = torch.zeros(E).index_add_(0, chosen.flatten(), torch.ones(12 * K)) / (12 * K)
    assert torch.allclose(aux, 0.1 * E * (fraction * scores.mean(0)).sum())
    aux.backward()
    assert moe.router.weight.grad.abs().sum() > 0
    assert MoE(H, FFN, E, K)(x, return_aux_loss=True)[1] is None


def test_moe_capacity_drops_copies():
    torch.manual_seed(3)
    full = MoE(H, FFN, E, K)
    capped = MoE(H, FFN, E, K, capacity_factor=0.5, pad_to_capacity=True)
    capped.load_state_dict(full.state_dict())
    x = torch.randn(20, H)
    assert not torch.allclose(full(x), capped(x))


def test_moe_rejects_bad_arguments():
    with pytest.raises(ValueError, match="score_function"):
        MoE(H, FFN, E, K, score_function="tanh")
    with pytest.raises(ValueError, match="topk"):
        MoE(H, FFN, E, E + 1)
    with pytest.raises(ValueError, match="activation"):
        MoE(H, FFN, E, K, activation="relu")
    with pytest.raises(ValueError, match="aux_loss_coeff"):
        MoE(H, FFN, E, K, aux_loss_coeff=-1)
    with pytest.raises(ValueError, match="pad_to_capacity"):
        MoE(H, FFN, E, K, pad_to_capacity=True)
    with pytest.raises(ValueError, match="hidden=6"):
        MoE(H, FFN, E, K)(torch.randn(3, H + 1))
    with pytest.raises(ValueError, match="group sizes"):
        GroupedExperts(2, H, FFN)(torch.randn(3, H), [3])


class _Mesh:
    def __init__(self, ndim, names):
        self.ndim, self.mesh_dim_names = ndim, names


def test_styles_reject_other_modules_and_meshes():
    with pytest.raises(TypeError, match="ExpertParallel applies to a MoE block"):
        ExpertParallel()._apply(torch.nn.Linear(2, 2), _Mesh(1, ("ep",)))
    with pytest.raises(ValueError, match=r"ExpertTensorParallel needs a 2-D mesh with dims \('ep', 'tp'\)"):
        ExpertTensorParallel()._apply(MoE(H, FFN, E, K), _Mesh(1, ("ep",)))
    with pytest.raises(ValueError, match="ExpertParallel needs"):
        ExpertParallel()._apply(MoE(H, FFN, E, K), _Mesh(2, ("dp", "tp")))
    sharded = MoE(H, FFN, E, K)
    sharded.experts.first_expert = 2
    with pytest.raises(ValueError, match="already sharded"):
        ExpertParallel()._apply(sharded, _Mesh(1, ("ep",)))
