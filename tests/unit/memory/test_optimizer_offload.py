"""OffloadOptimizer on CPU: equal to the device optimizer, state on the host tier, clear errors."""

from __future__ import annotations

import copy

import pytest
import torch

from hyper_adaptor.memory import OffloadOptimizer


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def train(net, opt, steps=3, sched=None):
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(4, 16, generator=g)
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


def storages(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("cls,kw", [(torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
                                    (torch.optim.SGD, dict(lr=1e-1, momentum=0.9)),
                                    (torch.optim.AdamW, dict(lr=1e-2))], ids=["Adam", "SGD", "AdamW"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_offload_equals_the_device_optimizer_after_3_steps(cls, kw, fraction):
    ref, net = model(), model()
    ref_opt = cls(ref.parameters(), **kw)
    opt = OffloadOptimizer(net.parameters(), cls, offload_fraction=fraction, **kw)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    train(ref, ref_opt, sched=ref_sched)
    train(net, opt, sched=sched)
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a, b)
    # the state lives on the host tier: keyed by the host masters, in storages apart from the parameters
    params = list(net.parameters())
    host_state = [v for s in opt.host_optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert host_state and not storages(host_state) & storages(params)
    assert set(opt.host_optimizer.state) <= set(opt.masters.values())
    assert not storages(opt.masters.values()) & storages(params)
    if fraction == 1.0:
        assert opt.device_optimizer is None and opt.state_bytes()["device"] == 0
    else:
        offloaded = sum(p.numel() for p in opt.offloaded_params)
        assert 0 < offloaded < sum(p.numel() for p in params)
        assert opt.state_bytes()["device"] > 0
    assert opt.state_bytes()["host"] > 0
    # optimizer.state[param] (as megatron reads it) finds each parameter's state, on its tier
    for p, q in zip(params, ref.parameters()):
        state = opt.state[p]
        assert set(state) == set(ref_opt.state[q])
        assert all(torch.equal(v, ref_opt.state[q][k]) for k, v in state.items())
        if p in opt.masters:
            assert all(v.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for v in state.values()
                       if isinstance(v, torch.Tensor))
    assert len(opt.state) == len(params)


def test_per_group_choice_and_predicate():
    net = model()
    first, second = list(net[0].parameters()), list(net[2].parameters())
    opt = OffloadOptimizer([{"params": first, "offload": True}, {"params": second, "offload": False}],
                           torch.optim.Adam, lr=1e-3)
    assert set(opt.offloaded_params) == set(first)
    opt = OffloadOptimizer(net.parameters(), torch.optim.Adam, offload_fn=lambda p, g: p.dim() == 2, lr=1e-3)
    assert {p for p in net.parameters() if p.dim() == 2} == set(opt.offloaded_params)
    opt = OffloadOptimizer(net.parameters(), torch.optim.Adam, offload_fraction=0.0, lr=1e-3)
    assert opt.host_optimizer is None and not opt.offloaded_params


def test_state_dict_round_trip():
    net, net2 = model(), model()
    opt = OffloadOptimizer(net.parameters(), torch.optim.Adam, lr=1e-2)
    train(net, opt, steps=2)
    net2.load_state_dict(net.state_dict())
    opt2 = OffloadOptimizer(net2.parameters(), torch.optim.Adam, lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(net, opt, steps=1)
    train(net2, opt2, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters()))
    with pytest.raises(ValueError, match="another split"):
        OffloadOptimizer(model().parameters(), torch.optim.Adam, offload_fraction=0.0).load_state_dict(opt.state_dict())


@pytest.mark.parametrize("fraction", [1.5, -0.1, True, "half", None])
def test_bad_fraction_is_a_clear_error(fraction):
    with pytest.raises(ValueError, match="offload_fraction must be a number in \\[0, 1\\]"):
        OffloadOptimizer(model().parameters(), torch.optim.Adam, offload_fraction=fraction)


def test_bad_optimizer_class_is_a_clear_error():
    with pytest.raises(TypeError, match="optimizer_class must be a torch.optim.Optimizer subclass"):
        OffloadOptimizer(model().parameters(), "adam")
