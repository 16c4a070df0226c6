"""hyper_adaptor.testing.peak_run in one process: the tracker's resize and host tier, and what the bytes
alive at the peak are classified as (the launched measurement is tests/e2e/test_peak_run.py)."""

import types

import pytest
import torch
import torch.nn as nn

from hyper_adaptor.testing.peak_run import TieredTracker, classify, measure

MIB = 2**20


def test_resize_in_place_is_seen_both_ways():
    with TieredTracker() as t:
        x = torch.empty(MIB, dtype=torch.uint8)
        storage = x.untyped_storage()
        storage.resize_(0)  # what HSDP level 3 and swap do to free a storage they keep
        assert t.live == 0
        storage.resize_(2 * MIB)
        assert t.live == 2 * MIB and t.peak == 2 * MIB
        del x, storage
        assert t.live == 0
    assert torch.UntypedStorage.resize_ is not None and "resize_" not in vars(TieredTracker)


def test_host_storages_count_apart_and_set_to_them_is_not_new():
    with TieredTracker() as t:
        with t.host():
            host = torch.empty(MIB, dtype=torch.uint8)
        device = torch.empty(3 * MIB, dtype=torch.uint8)
        view = torch.empty(0, dtype=torch.uint8).set_(host.untyped_storage())  # swap's view of a buffer
        assert (t.live, t.host_live, t.host_peak) == (3 * MIB, MIB, MIB)
        del host, view
        assert t.host_live == 0 and t.live == 3 * MIB
        del device


def test_set_to_a_storage_made_before_the_mode_is_not_counted():
    before = torch.empty(MIB, dtype=torch.uint8)
    with TieredTracker() as t:
        view = torch.empty(0, dtype=torch.uint8).set_(before.untyped_storage())
        assert t.live == 0
    del view


class _Buffer:  # megatron DDP's _ParamAndGradBuffer, as far as classification reads it
    def __init__(self, n):
        self.param_data = torch.zeros(n)
        self.grad_data = torch.zeros(n)


class _DDP(nn.Module):
    """A megatron-DDP-like chunk: parameters are views of param_data, main_grad views of grad_data, and
    the ``buffers`` attribute hides nn.Module.buffers as in megatron."""

    def __init__(self, hidden):
        super().__init__()
        self.module = nn.Linear(hidden, hidden, bias=False)
        buffer = _Buffer(hidden * hidden)
        self.module.weight.data = buffer.param_data.view(hidden, hidden)
        self.module.weight.main_grad = buffer.grad_data.view(hidden, hidden)
        self.register_buffer("rope", torch.zeros(hidden))
        self.buffers = [buffer]


def _step_under_tracker(bf16_main: bool):
    hidden = 64
    with TieredTracker() as t:
        chunk = _DDP(hidden)
        weight = chunk.module.weight
        if bf16_main:  # Float16OptimizerWithFloat16Params: an fp32 copy stepped by the torch optimizer
            main = weight.detach().clone().requires_grad_()
            inner = torch.optim.Adam([main])
            optimizer = types.SimpleNamespace(optimizer=inner, fp32_from_float16_groups=[[main]])
        else:
            main = weight
            optimizer = types.SimpleNamespace(optimizer=torch.optim.Adam([weight]))
        x = torch.randn(4, hidden)
        activation = chunk.module(x).relu()  # alive at the peak (the step's), freed before classification
        activation.sum().backward()
        weight.main_grad.add_(weight.grad)
        weight.grad = None
        main.grad = weight.main_grad
        optimizer.optimizer.step()  # the first step makes the state: the peak is here
        del activation, x
        return classify(list(t.at_peak), [chunk], optimizer), t.peak, hidden * hidden * 4


@pytest.mark.parametrize("bf16_main", [False, True], ids=["fp32", "main-copies"])
def test_classify_parts_at_the_peak(bf16_main):
    got, peak, w = _step_under_tracker(bf16_main)
    parts = got["parts"]
    assert sum(parts.values()) == peak
    # the weight's param_data and grad_data (the Linear's own weight storage was swapped for the buffer's
    # view and freed), the registered buffer
    assert parts["parameters"] == w + 64 * 4
    assert parts["gradients"] == w
    # Adam's two moments (+ the step count), and with main copies the fp32 main weight
    assert 2 * w <= parts["optimizer_state"] - (w if bf16_main else 0) <= 2 * w + 64
    assert got["main_parameters"] == (w if bf16_main else 0)
    assert parts["other"] > 0 and got["other_by_op"]  # the activations and temporaries of the backward


def test_measure_rejects_its_own_flags():
    with pytest.raises(ValueError, match="--train-iters"):
        measure(["--train-iters", "3"], 1)
    with pytest.raises(ValueError, match="nproc"):
        measure([], 0)
