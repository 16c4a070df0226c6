"""HyperParallel's spellings of the memory API: keyword forms, CheckpointPolicy values, the exclude wrapper."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_adaptor.memory import (
    CheckpointPolicy,
    SwapManager,
    checkpoint,
    checkpoint_exclude_wrapper,
    checkpoint_wrapper,
    swap_tensor_wrapper,
    unwrap,
)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def _grads(model, x):
    model.zero_grad()
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_checkpoint_policy_values_and_flag_names():
    assert [p.value for p in CheckpointPolicy] == [0, 1, 2, 3, 4]
    assert CheckpointPolicy("must_swap") is CheckpointPolicy.MUST_SWAP
    assert CheckpointPolicy(2) is CheckpointPolicy.MUST_RECOMPUTE
    with pytest.raises(ValueError):
        CheckpointPolicy("save_everything")


@pytest.mark.parametrize("kwargs", [{"policy": "full"}, {"early_stop": False}, {"policy_fn": None},
                                    {"policy_fn": lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE}])
def test_checkpoint_wrapper_takes_checkpoint_keywords(kwargs):
    x = torch.randn(4, 8)
    want = _grads(_mlp(), x)
    got = _grads(checkpoint_wrapper(_mlp(), **kwargs), x)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpoint_wrapper_rejects_unknown_keywords():
    with pytest.raises(TypeError, match="polcy"):
        checkpoint_wrapper(_mlp(), polcy="full")
    with pytest.raises(TypeError, match="policy"):
        checkpoint_wrapper(_mlp(), policy="full", policy_fn=lambda *a, **k: True)


class _CountSin(TorchDispatchMode):
    """Counts sin ops that really run (a cached op of selective checkpointing never reaches this mode)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.sin.default
        return func(*args, **(kwargs or {}))


class Sin(torch.nn.Module):
    def forward(self, h):
        return torch.sin(h)


def test_checkpoint_exclude_wrapper_saves_instead_of_recomputing():
    def run(exclude):
        inner = Sin()
        if exclude:
            checkpoint_exclude_wrapper(inner)
        x = torch.randn(4, 8, requires_grad=True)
        with _CountSin() as counter:
            out = checkpoint(lambda h: inner(h * 2).cos(), x)
            out.sum().backward()
        return x.grad, counter.count

    torch.manual_seed(1)
    a, recomputed = run(False)
    torch.manual_seed(1)
    b, saved = run(True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # cos's backward runs one sin of its own; the recompute adds one more unless the module is excluded
    assert (recomputed, saved) == (3, 2)
    with pytest.raises(ValueError, match="save_output"):
        checkpoint_exclude_wrapper(Sin(), save_output=False)


def test_exclude_wrapper_unwraps():
    m = checkpoint_exclude_wrapper(torch.nn.Linear(2, 2))
    assert "forward" not in unwrap(m).__dict__


def test_swap_manager_reference_methods():
    mgr = SwapManager(min_bytes=0)
    t = torch.randn(64, 64)
    want = t.clone()
    swap_tensor_wrapper(t, tag="w", manager=mgr)
    mgr.launch_offload("w", copy_stream=None)
    mgr.wait_offload(group_name="w")
    assert t.untyped_storage().nbytes() == 0
    mgr.set_forward_prefetch_layer("layer0", "w")
    g = mgr.open_group("layer0")            # opening layer0 loads "w" back
    mgr.close_group(g)
    mgr.wait_load("w")
    torch.testing.assert_close(t, want, rtol=0, atol=0)
