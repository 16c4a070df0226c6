"""checkpoint / checkpoint_wrapper with each CheckpointPolicy (MUST_SWAP included) on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_adaptor.memory import (
    CheckpointPolicy,
    GroupState,
    SwapError,
    SwapManager,
    api,
    checkpoint,
    checkpoint_wrapper,
    swap_wrapper,
)
from tests.unit.memory._models import batch, make_stack, step

LAYERS = 3
aten = torch.ops.aten


class CountOps(TorchDispatchMode):
    """How many times each aten op ran (forward, recompute and backward)."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def policy_for(policy, ops=(aten.sin.default, aten.gelu.default)):
    """``policy`` for the MLP's activation ops, recompute for everything else."""
    return lambda ctx, op, *a, **k: policy if op in ops else CheckpointPolicy.PREFER_RECOMPUTE


def close(grads, ref, tol=1e-6):
    return all(torch.allclose(a, b, rtol=0, atol=tol * max(1.0, b.abs().max().item())) for a, b in zip(grads, ref))


@pytest.mark.parametrize("policy", list(CheckpointPolicy), ids=lambda p: p.name)
def test_each_policy_gives_the_reference_gradients(policy):
    stack, x = make_stack(LAYERS), batch()
    ref_loss, ref_grads = step(stack, x)
    mgr = SwapManager(min_bytes=0)
    for i, layer in enumerate(stack):
        checkpoint_wrapper(layer, policy_for(policy), manager=mgr, tag=i)
    with CountOps() as counter:
        loss, grads = step(stack, x)
    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6) and close(grads, ref_grads)
    # sin's backward is cos: every sin that ran is a forward or a recompute
    recomputed = policy in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
    assert counter.counts[aten.sin.default] == LAYERS * (2 if recomputed else 1)
    assert counter.counts[aten.mm.default] > 0  # the rest of the layer was recomputed under every policy
    swapped = policy is CheckpointPolicy.MUST_SWAP
    assert (mgr.moved_bytes > 0) == swapped


def test_full_recompute_without_policy():
    stack, x = make_stack(LAYERS), batch()
    ref_loss, ref_grads = step(stack, x)
    for layer in stack:
        checkpoint_wrapper(layer)
    with CountOps() as counter:
        loss, grads = step(stack, x)
    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6) and close(grads, ref_grads)
    assert counter.counts[aten.sin.default] == 2 * LAYERS


@pytest.mark.skipif(not api.POLICY_SEES_OUTPUT, reason="this torch gives the policy no ctx.op_output to record; "
                    "test_must_swap_where_the_policy_runs_before_the_op covers that path")
def test_must_swap_outputs_are_on_the_host_between_forward_and_backward():
    stack, x = make_stack(LAYERS), batch()
    ref_loss, ref_grads = step(stack, x)
    mgr = SwapManager(min_bytes=0)
    cached = []  # (layer, the storage selective checkpointing keeps for the MUST_SWAP op, its bytes)

    def policy(ctx, op, *a, **k):
        if op is aten.gelu.default:
            if not ctx.is_recompute:
                cached.append((mgr.current_group.tag, ctx.op_output.untyped_storage(),
                               ctx.op_output.detach().clone()))
            return CheckpointPolicy.MUST_SWAP
        return CheckpointPolicy.PREFER_RECOMPUTE

    for i, layer in enumerate(stack):
        checkpoint_wrapper(layer, policy, manager=mgr, tag=i)

    def check():
        groups = {g.tag: g for g in mgr.groups()}
        for tag, storage, value in cached:
            if tag == LAYERS - 1:   # last layer: stays
                assert storage.nbytes() == value.numel() * value.element_size()
            else:                   # device storage emptied, its bytes in a host buffer
                assert storage.nbytes() == 0
                host = [e for e in groups[tag].entries.values() if e.host is not None]
                assert any(torch.equal(e.host.view(value.dtype)[: value.numel()].view(value.shape), value)
                           for e in host)
        assert groups[0].state is GroupState.OFFLOADED

    loss, grads = step(stack, x, between=check)
    assert len(cached) == LAYERS
    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6) and close(grads, ref_grads)


def test_swap_inputs_moves_the_checkpoint_inputs():
    stack, x = make_stack(LAYERS), batch()
    ref_loss, ref_grads = step(stack, x)
    mgr = SwapManager(min_bytes=0)
    inputs = []
    for i, layer in enumerate(stack):
        layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0].untyped_storage()))
        checkpoint_wrapper(layer, swap_inputs=True, manager=mgr, tag=i)

    def check():
        # layer 1's input (layer 0's output) is held by layer 1's checkpoint only: on the host now
        assert inputs[1].nbytes() == 0 and inputs[LAYERS - 1].nbytes() > 0

    loss, grads = step(stack, x, between=check)
    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6) and close(grads, ref_grads)


def test_checkpoint_inside_a_swapped_layer_with_group_swap():
    stack, x = make_stack(LAYERS), batch()
    ref_loss, ref_grads = step(stack, x)
    mgr = SwapManager(min_bytes=0)
    for i, layer in enumerate(stack):
        inner = layer.mlp
        layer.mlp = lambda h, inner=inner: checkpoint(inner, h, policy_fn=policy_for(CheckpointPolicy.MUST_SWAP),
                                                      group_swap=True, manager=mgr)
        swap_wrapper(layer, manager=mgr, tag=i)
    loss, grads = step(stack, x)
    assert [t for kind, t in mgr.trace if kind == "offload"] == [0, 1]  # one group per layer
    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6) and close(grads, ref_grads)


def test_torch_policies_and_bools_are_accepted():
    x = torch.randn(4, 8, requires_grad=True)
    for decision in (True, False, torch_checkpoint.CheckpointPolicy.MUST_SAVE):
        y = checkpoint(lambda t: t.sin().cos(), x, policy_fn=lambda *a, d=decision, **k: d,
                       manager=SwapManager(min_bytes=0))
        y.sum().backward()


def test_misuse_is_a_clear_error():
    x = torch.randn(4, 8, requires_grad=True)
    mgr = SwapManager(min_bytes=0)
    with pytest.raises(SwapError, match="MUST_SWAP for aten.sin.default outside any swap group"):
        checkpoint(torch.sin, x * 1, policy_fn=policy_for(CheckpointPolicy.MUST_SWAP), group_swap=True, manager=mgr)
    with pytest.raises(SwapError, match="swap_inputs=True, group_swap=True\\) needs an open swap group"):
        checkpoint(torch.sin, x * 1, swap_inputs=True, group_swap=True, manager=mgr)
    with pytest.raises(ValueError, match="context_fn cannot be combined"):
        checkpoint(torch.sin, x, policy_fn=policy_for(CheckpointPolicy.MUST_SAVE), context_fn=lambda: None)
    with pytest.raises(TypeError, match="policy_fn returned 'save'"):
        checkpoint(torch.sin, x, policy_fn=lambda *a, **k: "save", manager=mgr)
    with pytest.raises(TypeError, match="checkpoint_wrapper: policy must be"):
        checkpoint_wrapper(torch.nn.Linear(2, 2), policy=3)
    assert mgr._open == []  # a failed call leaves no group open


def test_policy_table_and_op_list_and_torch_cpu_offload():
    stack, x = make_stack(LAYERS), batch()
    ref_loss, ref_grads = step(stack, x)
    forms = [
        {aten.sin.default: CheckpointPolicy.MUST_SAVE},                    # {op: policy}, others recomputed
        [aten.sin],                                                        # ops (or packets) to save
        {aten.sin.default: torch_checkpoint.CheckpointPolicy.MUST_CPU_OFFLOAD},  # torch's, served as MUST_SWAP
    ]
    for form in forms:
        stack = make_stack(LAYERS)
        mgr = SwapManager(min_bytes=0)
        for i, layer in enumerate(stack):
            checkpoint_wrapper(layer, form, manager=mgr, tag=i)
        with CountOps() as counter:
            loss, grads = step(stack, x)
        assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6) and close(grads, ref_grads)
        assert counter.counts[aten.sin.default] == LAYERS  # saved, not recomputed
        is_offload = isinstance(form, dict) and isinstance(next(iter(form.values())), torch_checkpoint.CheckpointPolicy)
        assert (mgr.moved_bytes > 0) == is_offload


def test_must_swap_never_empties_a_parameter_or_the_callers_input():
    mgr = SwapManager(min_bytes=0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 1
    swap_all = lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SWAP  # noqa: E731  (views of w and h included)
    y = checkpoint(lambda t: lin(t.view(4, 8)).relu(), h, policy_fn=swap_all, manager=mgr)
    z = checkpoint(lambda t: t * 2, y, policy_fn=swap_all, manager=mgr)  # the first group moves now
    assert mgr.moved_bytes > 0
    assert lin.weight.untyped_storage().nbytes() == 8 * 8 * 4 and h.untyped_storage().nbytes() == 4 * 8 * 4
    z.sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    w2, b2 = lin.weight.detach().clone().requires_grad_(True), lin.bias.detach().clone().requires_grad_(True)
    (torch.nn.functional.linear(x2 * 1, w2, b2).relu() * 2).sum().backward()
    assert torch.allclose(x.grad, x2.grad) and torch.allclose(lin.weight.grad, w2.grad)


def test_must_swap_where_the_policy_runs_before_the_op(monkeypatch):
    """torch releases before 2.13 ask the policy before the op runs (no ctx.op_output; 2.11 on our GPU
    machine): the output then reaches the swap group through the engine's own dispatch mode."""
    monkeypatch.setattr(api, "POLICY_SEES_OUTPUT", False)
    stack, x = make_stack(LAYERS), batch()
    ref_loss, ref_grads = step(stack, x)
    mgr = SwapManager(min_bytes=0)
    for i, layer in enumerate(stack):
        checkpoint_wrapper(layer, policy_for(CheckpointPolicy.MUST_SWAP), manager=mgr, tag=i)
    emptied = []

    def check():
        groups = {g.tag: g for g in mgr.groups()}
        emptied.extend(e.storage.nbytes() == 0 for i in range(LAYERS - 1) for e in groups[i].entries.values()
                       if e.mode == "resize")

    with CountOps() as counter:
        loss, grads = step(stack, x, between=check)
    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6) and close(grads, ref_grads)
    assert counter.counts[aten.sin.default] == LAYERS  # saved (then swapped), never recomputed
    assert emptied and all(emptied) and mgr.moved_bytes > 0 and mgr.moved_bytes == mgr.loaded_bytes
