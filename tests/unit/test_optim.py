"""hyper_adaptor.optim on one process: Muon's step, the parameter split, ChainedOptimizer's state round trip
and the LR curves."""

import copy
import math

import pytest
import torch
from torch import nn

from hyper_adaptor.optim import (
    AdamW,
    ChainedLR,
    ChainedOptimizer,
    Muon,
    get_hyper_lr_scheduler,
    get_hyper_optimizer,
    lr_multiplier,
    newton_schulz,
    split_params,
)

# --------------------------------------------------------------------------- Muon

def _textbook_ns(g, steps):
    """Quintic Newton-Schulz written out in float64, transposing tall matrices."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.t()
    x = x / max(float(torch.linalg.matrix_norm(x)), 1e-7)
    for _ in range(steps):
        a = x @ x.t()
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * (a @ a)) @ x
    return x.t() if tall else x


def _textbook_muon(params, grads_per_step, lr, mu, nesterov, wd, adjust):
    params = [p.detach().double().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g.double()
            bufs[i] = mu * bufs[i] + g
            u = g + mu * bufs[i] if nesterov else bufs[i]
            o = _textbook_ns(u, 5)
            rows, cols = p.shape
            scale = math.sqrt(max(1.0, rows / cols)) if adjust == "original" else 0.2 * math.sqrt(max(rows, cols))
            params[i] = p * (1 - lr * wd) - lr * scale * o
    return params


def _run(opt_cls, shapes, grads_per_step, **kw):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = opt_cls(params, **kw)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


SHAPES = [(16, 32), (48, 16), (24, 24)]


def _grads(steps=3):
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(*s, generator=gen) for s in SHAPES] for _ in range(steps)]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_muon_matches_textbook_reference(nesterov, adjust):
    grads = _grads()
    ours = _run(Muon, SHAPES, grads, lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=0.1, adjust_lr=adjust)
    torch.manual_seed(0)
    init = [torch.randn(*s) for s in SHAPES]
    ref = _textbook_muon(init, grads, 0.02, 0.9, nesterov, 0.1, adjust)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch has no Muon")
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_torch_muon(adjust, nesterov):
    # Compared options: lr, weight_decay, momentum, nesterov, ns_steps, eps, adjust_lr (torch's adjust_lr_fn).
    # torch keeps its buffer as an exponential average (a (1 - momentum) multiple of ours), which Newton-Schulz's
    # normalisation removes, and iterates in bfloat16: so the parameter change after three steps agrees to
    # 2e-2 of its norm, not bitwise.
    grads = _grads()
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_steps=5, eps=1e-7)
    ours = _run(Muon, SHAPES, grads, adjust_lr=adjust, **kw)
    theirs = _run(torch.optim.Muon, SHAPES, grads, adjust_lr_fn=adjust, **kw)
    torch.manual_seed(0)
    init = [torch.randn(*s) for s in SHAPES]
    for p0, a, b in zip(init, ours, theirs):
        da, db = a - p0, b - p0
        assert (da - db).norm() / db.norm() < 2e-2


def test_newton_schulz_orthogonalises_and_commutes_with_transpose():
    g = torch.randn(32, 96, generator=torch.Generator().manual_seed(2))
    o = newton_schulz(g, 5)
    s = torch.linalg.svdvals(o)
    # Five quintic steps put the singular values near 1, not at 1 (the coefficients trade accuracy for speed).
    assert s.min() > 0.6 and s.max() < 1.25
    torch.testing.assert_close(newton_schulz(g.t().contiguous(), 5), o.t(), rtol=0, atol=1e-6)
    assert newton_schulz(g.bfloat16(), 5).dtype == torch.bfloat16


def test_muon_refuses_non_matrix_parameters():
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        Muon([nn.Parameter(torch.zeros(8))], lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(2, 3, 4\)"):
        Muon([nn.Parameter(torch.zeros(2, 3, 4))], lr=0.1)
    with pytest.raises(ValueError, match="adjust_lr"):
        Muon([nn.Parameter(torch.zeros(2, 2))], lr=0.1, adjust_lr="rms")
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.zeros(3))


def test_fused_qkv_blocks_equal_separate_head_matrices():
    heads, groups, head_dim, hidden = 4, 2, 8, 32
    gen = torch.Generator().manual_seed(3)
    blocks = heads + 2 * groups
    w = [torch.randn(head_dim, hidden, generator=gen) for _ in range(blocks)]
    g = [[torch.randn(head_dim, hidden, generator=gen) for _ in range(blocks)] for _ in range(2)]
    kw = dict(lr=0.05, momentum=0.9, weight_decay=0.01, adjust_lr="match_rms_adamw")
    separate = [nn.Parameter(x.clone()) for x in w]
    opt_sep = Muon(separate, **kw)
    fused = nn.Parameter(torch.cat(w))
    opt_fused = Muon([{"params": [fused], "row_blocks": blocks}], **kw)
    for step_grads in g:
        for p, x in zip(separate, step_grads):
            p.grad = x.clone()
        fused.grad = torch.cat(step_grads)
        opt_sep.step()
        opt_fused.step()
    torch.testing.assert_close(fused.detach(), torch.cat([p.detach() for p in separate]), rtol=0, atol=1e-6)
    # ... and orthogonalising the fused matrix whole would be a different update.
    whole = nn.Parameter(torch.cat(w))
    opt_whole = Muon([whole], **kw)
    for step_grads in g:
        whole.grad = torch.cat(step_grads)
        opt_whole.step()
    assert not torch.allclose(whole, fused, atol=1e-4)


# --------------------------------------------------------------------------- split and ChainedOptimizer

class _Block(nn.Module):
    def __init__(self, hidden=16, heads=2):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.linear_qkv = nn.Linear(hidden, 3 * hidden)
        self.linear_proj = nn.Linear(hidden, hidden)
        self.mlp = nn.Linear(hidden, 2 * hidden, bias=False)
        self.mlp_out = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.linear_qkv(h).chunk(3, dim=-1)
        x = x + self.linear_proj(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)
        return x + self.mlp_out(torch.relu(self.mlp(x)))


class _TinyGPT(nn.Module):
    def __init__(self, vocab=40, hidden=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos_embed = nn.Parameter(torch.zeros(8, hidden))
        self.layers = nn.ModuleList([_Block(hidden), _Block(hidden)])
        self.final_norm = nn.LayerNorm(hidden)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos_embed[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.output_layer(self.final_norm(x))


def test_split_params_sends_hidden_matrices_to_muon():
    model = _TinyGPT()
    muon, adamw = split_params(model)
    hidden = {f"layers.{i}.{n}.weight" for i in range(2) for n in ("linear_qkv", "linear_proj", "mlp", "mlp_out")}
    assert {n for n, _ in muon} == hidden
    assert {n for n, _ in adamw} == {n for n, _ in model.named_parameters()} - hidden
    assert "tok.weight" in dict(adamw) and "output_layer.weight" in dict(adamw) and "pos_embed" in dict(adamw)
    muon, _ = split_params(model, exclude=lambda n, p: "mlp" in n)
    assert all("mlp" not in n for n, _ in muon) and muon


def test_get_hyper_optimizer_groups():
    model = _TinyGPT()
    opt = get_hyper_optimizer(model, lr=1e-3, weight_decay=0.1, muon_lr=0.02, num_heads=2)
    assert isinstance(opt, ChainedOptimizer)
    muon, adam = opt.optimizers
    assert isinstance(muon, Muon) and isinstance(adam, AdamW)
    fused = [g for g in muon.param_groups if g["row_blocks"] != 1]
    assert len(fused) == 1 and fused[0]["row_blocks"] == 6 and len(fused[0]["params"]) == 2
    assert all(g["lr"] == 0.02 for g in muon.param_groups) and all(g["lr"] == 1e-3 for g in adam.param_groups)
    assert [g["weight_decay"] for g in adam.param_groups] == [0.1, 0.0]
    assert all(p.dim() < 2 for p in adam.param_groups[1]["params"])
    only_adam = get_hyper_optimizer(model, lr=1e-3, optimizer="adamw")
    assert isinstance(only_adam, AdamW)
    with pytest.raises(ValueError, match="'sgd'"):
        get_hyper_optimizer(model, lr=1e-3, optimizer="sgd")


def _train(model, opt, sched, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 40, (2, 8), generator=gen)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _build(model):
    opt = get_hyper_optimizer(model, lr=1e-3, weight_decay=0.1, muon_lr=0.02, num_heads=2)
    return opt, get_hyper_lr_scheduler(opt, 2, 10, style="wsd", wsd_decay_steps=4, wsd_decay_style="cosine")


def test_chained_state_round_trip_is_bitwise():
    torch.manual_seed(0)
    model = _TinyGPT()
    opt, sched = _build(model)
    assert isinstance(sched, ChainedLR)
    _train(model, opt, sched, 3, seed=5)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))
    _train(model, opt, sched, 3, seed=6)

    fresh = _TinyGPT()
    fresh.load_state_dict(saved[0])
    opt2, sched2 = _build(fresh)
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    _train(fresh, opt2, sched2, 3, seed=6)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert sched.get_last_lr() == sched2.get_last_lr()
    with pytest.raises(ValueError, match="expected 2 optimizers"):
        opt2.load_state_dict({"optimizers": [opt.optimizers[0].state_dict()]})


# --------------------------------------------------------------------------- LR schedules

def test_schedule_curves_follow_their_formulas():
    w, t, m = 10, 110, 0.1
    f = lr_multiplier
    for style in ("constant", "linear", "cosine"):
        assert f(0, w, t, style, m) == 0.0 and f(5, w, t, style, m) == 0.5 and f(w, w, t, style, m) == 1.0
    assert f(60, w, t, "constant", m) == 1.0 and f(500, w, t, "constant", m) == 1.0
    assert f(60, w, t, "linear", m) == pytest.approx(m + (1 - m) * 0.5)
    assert f(t, w, t, "linear", m) == pytest.approx(m)
    assert f(35, w, t, "cosine", m) == pytest.approx(m + (1 - m) * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert f(t, w, t, "cosine", m) == pytest.approx(m) and f(t + 1, w, t, "cosine", m) == m
    d = 40  # decay starts at step 70
    wsd = {"linear": lambda r: 1 - r, "cosine": lambda r: 0.5 * (1 + math.cos(math.pi * r)),
           "exponential": lambda r: 2 * 0.5 ** r - 1, "1-sqrt": lambda r: 1 - math.sqrt(r)}
    for style, coeff in wsd.items():
        assert f(11, w, t, "wsd", m, d, style) == 1.0 and f(70, w, t, "wsd", m, d, style) == 1.0
        for step in (71, 80, 90, 110):
            r = (step - 70) / d
            assert f(step, w, t, "wsd", m, d, style) == pytest.approx(m + (1 - m) * coeff(r)), (style, step)
        assert f(t, w, t, "wsd", m, d, style) == pytest.approx(m)


def test_scheduler_drives_the_optimizer_lr():
    p = nn.Parameter(torch.zeros(4, 4))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = get_hyper_lr_scheduler(opt, 2, 6, style="linear")
    seen = [opt.param_groups[0]["lr"]]
    for _ in range(7):
        opt.step()
        sched.step()
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([0.0, 1.0, 2.0, 1.5, 1.0, 0.5, 0.0, 0.0])


@pytest.mark.parametrize("kw, match", [
    (dict(style="step"), "style"),
    (dict(style="wsd", wsd_decay_steps=None), "wsd_decay_steps"),
    (dict(style="wsd", wsd_decay_steps=4, wsd_decay_style="minus_sqrt"), "wsd_decay_style"),
    (dict(min_lr_ratio=2.0), "min_lr_ratio"),
])
def test_scheduler_refuses_bad_settings(kw, match):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0)
    with pytest.raises(ValueError, match=match):
        get_hyper_lr_scheduler(opt, 2, 10, **kw)
    with pytest.raises(ValueError, match="total_steps"):
        get_hyper_lr_scheduler(opt, 10, 10)


@pytest.mark.parametrize("ours, theirs", [("linear", "linear"), ("cosine", "cosine"),
                                          ("exponential", "exponential"), ("1-sqrt", "minus_sqrt")])
def test_wsd_equals_megatron(ours, theirs):
    # The adaptor's import shims let megatron.core import here (no triton); only this test needs megatron.
    import hyper_adaptor.megatron_adaptor  # noqa: F401

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    max_lr, min_lr, warmup, total, decay = 3e-4, 3e-5, 5, 50, 20
    meg_opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=max_lr)
    meg = OptimizerParamScheduler(meg_opt, init_lr=0.0, max_lr=max_lr, min_lr=min_lr, lr_warmup_steps=warmup,
                                  lr_decay_steps=total, lr_decay_style="WSD", start_wd=0.0, end_wd=0.0,
                                  wd_incr_steps=total, wd_incr_style="constant", wsd_decay_steps=decay,
                                  lr_wsd_decay_style=theirs)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=max_lr)
    sched = get_hyper_lr_scheduler(opt, warmup, total, style="wsd", min_lr_ratio=min_lr / max_lr,
                                   wsd_decay_steps=decay, wsd_decay_style=ours)
    for step in range(total + 3):
        assert opt.param_groups[0]["lr"] == pytest.approx(meg_opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15), step
        meg.step(1)
        sched.step()


def test_split_hooks_and_bad_input():
    model = _TinyGPT()
    muon, adamw = split_params(model, muon_filter=lambda n, p: n.endswith("mlp.weight"))
    assert {n for n, _ in muon} == {"layers.0.mlp.weight", "layers.1.mlp.weight"}
    with pytest.raises(ValueError, match=r"row_blocks=7 does not divide .* shape \(48, 16\)"):
        get_hyper_optimizer(model, lr=1e-3, num_heads=3, num_query_groups=2)
    with pytest.raises(TypeError, match="dict"):
        ChainedOptimizer([{}])
    with pytest.raises(ValueError, match="at least one"):
        ChainedOptimizer([])


def test_hyperparallel_forms_of_the_optimizer_api():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = get_hyper_optimizer(model, ["0.weight"], [model[0].bias, *model[1].parameters()],
                              muon_kwargs={"lr": 0.01}, adamw_kwargs={"lr": 1e-3})
    assert isinstance(opt, ChainedOptimizer) and opt.model is model
    assert [type(o).__name__ for o in opt] == ["Muon", "AdamW"]
    assert set(opt.named_optimizers) == {"muon", "adamw"}
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="nope"):
        get_hyper_optimizer(model, ["nope"], [])
    with pytest.raises(ValueError, match="flatten"):
        ChainedOptimizer(model, {"a": torch.optim.SGD(model.parameters(), lr=0.1)}, flatten=True)
    assert Muon([nn.Parameter(torch.zeros(2, 2))]).defaults["weight_decay"] == 0.1
