"""Weight-gradient deferral (hyper_adaptor/parallel/pipeline/wgrad.py): the zero-bubble I/W split of nn.Linear.

Deferred weight gradients equal immediate ones bitwise (the same mm, the same accumulation); outside the
context a routed layer's gradients are torch's own, bitwise; the main_grad path accumulates through
wgrad_accum; queued tensors are released by run() / clear().
"""

import copy
import gc
import weakref

import pytest
import torch

from hyper_adaptor.parallel.pipeline import wgrad
from hyper_adaptor.parallel.pipeline.wgrad import (
    WeightGradQueue,
    defer_weight_grads,
    disable_weight_deferral,
    enable_weight_deferral,
)

SHAPES = [(7, 16), (3, 5, 16)]


def mlp(bias=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=bias), torch.nn.GELU(), torch.nn.Linear(32, 8, bias=bias))


def run(model, x, queue=None):
    leaf = x.clone().requires_grad_()
    if queue is None:
        model(leaf).square().sum().backward()
    else:
        with defer_weight_grads(queue):
            model(leaf).square().sum().backward()
    return leaf.grad


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=["2d", "3d"])
def test_routed_layer_is_torch_outside_the_context(shape, bias):
    plain = mlp(bias)
    routed = copy.deepcopy(plain)
    assert enable_weight_deferral(routed) == 2
    x = torch.randn(shape)
    for _ in range(2):  # the second call accumulates onto .grad
        assert torch.equal(run(plain, x), run(routed, x))
    assert torch.equal(plain(x), routed(x))
    for a, b in zip(plain.parameters(), routed.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("shape", SHAPES, ids=["2d", "3d"])
def test_deferred_equals_immediate(shape):
    immediate, deferred = mlp(), mlp()
    enable_weight_deferral(immediate)
    enable_weight_deferral(deferred)
    x = torch.randn(shape)
    for micro in range(3):
        xm = x + micro
        dx_now = run(immediate, xm)
        queue = WeightGradQueue()
        dx_later = run(deferred, xm, queue)
        assert torch.equal(dx_now, dx_later)
        assert len(queue) == 2
        for layer in (deferred[0], deferred[2]):
            # bias gradient now, weight gradient not yet (first micro: nothing at all so far)
            assert layer.bias.grad is not None
            assert (layer.weight.grad is None) == (micro == 0)
        queue.run()
        assert len(queue) == 0
    for a, b in zip(immediate.parameters(), deferred.parameters()):
        assert torch.equal(a.grad, b.grad)
    # and torch's own Linear gives the same within fp32 rounding (bitwise in practice: same formulas)
    plain = mlp()
    for micro in range(3):
        run(plain, x + micro)
    for a, b in zip(plain.parameters(), deferred.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_main_grad_path(dtype):
    model = mlp().to(dtype)
    enable_weight_deferral(model)
    for layer in (model[0], model[2]):
        layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
        layer.weight.grad_added_to_main_grad = False
    x = torch.randn(4, 6, 16, dtype=dtype)
    queue = WeightGradQueue()
    with defer_weight_grads(queue):
        h = model[0](x.clone().requires_grad_())
        out = model[2](model[1](h))
        out.float().square().sum().backward()
    inputs = [(item[0], item[1]) for item in queue._items]
    expected = [g.float().reshape(-1, g.shape[-1]).t() @ a.float().reshape(-1, a.shape[-1]) for a, g in inputs]
    del inputs
    queue.run()
    # queued in backward order: the last layer first
    for layer, want in zip((model[2], model[0]), expected):
        assert layer.weight.grad is None
        assert layer.weight.grad_added_to_main_grad is True
        torch.testing.assert_close(layer.weight.main_grad, want, rtol=1e-6, atol=1e-6)
    if dtype is torch.float32:  # same as an immediate backward into .grad
        ref = mlp()
        run(ref, x)
        torch.testing.assert_close(model[0].weight.main_grad, ref[0].weight.grad, rtol=0, atol=1e-6)


def test_queue_releases_what_it_holds():
    model = mlp()
    enable_weight_deferral(model)
    queue = WeightGradQueue()
    run(model, torch.randn(5, 16), queue)
    refs = [weakref.ref(t) for item in queue._items for t in item[:2]]
    assert all(r() is not None for r in refs)
    queue.run()
    gc.collect()
    assert all(r() is None for r in refs), "run() must drop the queued input / output gradient"
    run(model, torch.randn(5, 16), queue)
    refs = [weakref.ref(t) for item in queue._items for t in item[:2]]
    queue.clear()
    gc.collect()
    assert all(r() is None for r in refs)
    assert wgrad._ACTIVE == []


def test_context_is_left_on_error_and_frozen_weights_queue_nothing():
    model = mlp()
    enable_weight_deferral(model)
    model[0].weight.requires_grad_(False)
    queue = WeightGradQueue()
    with pytest.raises(RuntimeError, match="boom"):
        with defer_weight_grads(queue):
            run(model, torch.randn(2, 16))
            raise RuntimeError("boom")
    assert wgrad._ACTIVE == []
    assert len(queue) == 1  # only the trainable layer
    assert model[0].weight.grad is None


def test_disable_restores_the_class_forward():
    model = mlp()
    enable_weight_deferral(model)
    assert "forward" in model[0].__dict__
    disable_weight_deferral(model)
    assert "forward" not in model[0].__dict__ and "forward" not in model[2].__dict__
    queue = WeightGradQueue()
    run(model, torch.randn(2, 16), queue)
    assert len(queue) == 0 and model[0].weight.grad is not None
