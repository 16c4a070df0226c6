"""OffloadedHybridOptimizer (hyper_adaptor/patches/memory/hybrid_optimizer.py) on its own, one process: the class
megatron's distributed optimizer builds for --use-precision-aware-optimizer --optimizer-cpu-offload.
bf16 parameter shards with fp32 ``decoupled_grad``, as megatron hands them over; megatron's whole path
(bitwise against its plain bf16 distributed optimizer, checkpoints) is in
tests/distributed/test_optimizer_offload_megatron.py."""

from __future__ import annotations

import pytest
import torch

from hyper_adaptor.patches.memory.hybrid_optimizer import OffloadedHybridOptimizer

SIZES = (96, 40, 7)
# what megatron's factory passes its CPU-offload optimizer (apex / TE style Adam arguments included)
FACTORY = dict(cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True,
               pin_cpu_grads=True, pin_cpu_params=True, overlap_cpu_optimizer_d2h_h2d=False, lr=1e-2,
               weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, bias_correction=True, fused=True)


def shards(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(torch.bfloat16) for n in SIZES]


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=g) for n in SIZES]


def step_with(opt, params, step):
    for p, grad in zip(params, grads(step)):
        p.decoupled_grad = grad
    opt.step()
    opt.zero_grad()


def reference(steps):
    """megatron's plain path: fp32 main copies stepped by torch's AdamW, then rounded into the bf16 shards."""
    params = shards()
    mains = [p.float() for p in params]
    opt = torch.optim.AdamW(mains, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for step in range(steps):
        for m, grad in zip(mains, grads(step)):
            m.grad = grad
        opt.step()
        for p, m in zip(params, mains):
            p.copy_(m)
    return params, mains


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
def test_steps_equal_fp32_main_copies_bitwise_and_keep_the_masters_where_asked(fraction):
    params = shards()
    opt = OffloadedHybridOptimizer([{"params": params}], offload_fraction=fraction, **FACTORY)
    for step in range(3):
        step_with(opt, params, step)
    want_params, want_mains = reference(3)
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert all(torch.equal(opt.state[p]["master_param"], m) for p, m in zip(params, want_mains))
    engine = opt.engine
    offloaded = sum(p.numel() for p in engine.masters)
    assert (offloaded == sum(SIZES)) if fraction == 1.0 else (offloaded < sum(SIZES))
    # every fp32 master is the engine's: on the host for the offloaded share, on the device for the rest
    assert sum(m.numel() for m in engine.device_masters.values()) == sum(SIZES) - offloaded
    assert all(m.dtype == torch.float32 for m in (*engine.masters.values(), *engine.device_masters.values()))
    # the factory's apex / TE style arguments do not reach torch's AdamW (fused=True would change its numerics)
    for optimizer in opt.sub_optimizers:
        assert all("bias_correction" not in g and g["fused"] is None for g in optimizer.param_groups)


def test_state_megatron_reads_is_the_engines_own_tensors():
    params = shards()
    opt = OffloadedHybridOptimizer([{"params": params}], offload_fraction=1.0, **FACTORY)
    step_with(opt, params, 0)
    for p in params:
        state = opt.state[p]
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "master_param", "step"]
        inner = opt.engine.host_optimizer.state[opt.engine.masters[p]]
        assert state["exp_avg"] is inner["exp_avg"] and state["master_param"] is opt.engine.masters[p]


def test_dummy_step_creates_zero_state_and_changes_nothing():
    params = shards()
    before = [p.clone() for p in params]
    opt = OffloadedHybridOptimizer([{"params": params}], offload_fraction=0.5, **FACTORY)
    opt.dummy_step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    for p in params:
        state = opt.state[p]
        assert torch.equal(state["master_param"], p.float())
        assert all(not v.any() for k, v in state.items() if k != "master_param")  # moments 0, step 0


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_state_written_by_megatron_replaces_the_engines_before_the_next_step(fraction):
    # a checkpoint's tensors set into state[param] (new tensors, not the engine's, no sync call: megatron's
    # dp_reshardable load does that) are what the next step continues from
    trained = shards()
    a = OffloadedHybridOptimizer([{"params": trained}], offload_fraction=fraction, **FACTORY)
    for step in range(2):
        step_with(a, trained, step)
    saved = {i: {k: v.clone() for k, v in a.state[p].items()} for i, p in enumerate(trained)}

    fresh = shards(seed=1)  # other values everywhere until loaded
    b = OffloadedHybridOptimizer([{"params": fresh}], offload_fraction=fraction, **FACTORY)
    b.dummy_step()
    for i, p in enumerate(fresh):
        p.copy_(trained[i])  # the model's weights (megatron loads them into the parameters)
        for k, v in saved[i].items():
            b.state[p][k] = v.clone()
    step_with(a, trained, 2)
    step_with(b, fresh, 2)
    assert all(torch.equal(x, y) for x, y in zip(trained, fresh))
    assert all(torch.equal(a.state[x]["master_param"], b.state[y]["master_param"]) for x, y in zip(trained, fresh))


def test_update_fp32_param_by_new_param_rereads_the_masters():
    params = shards()
    opt = OffloadedHybridOptimizer([{"params": params}], offload_fraction=0.5, **FACTORY)
    step_with(opt, params, 0)
    for p in params:
        p.fill_(0.5)
    opt.update_fp32_param_by_new_param()
    assert all(torch.equal(opt.state[p]["master_param"], torch.full(p.shape, 0.5)) for p in params)
