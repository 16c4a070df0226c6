"""SwapManager / swap / swap_wrapper on CPU: exactness, where the bytes are, prefetch order, pool reuse."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hyper_adaptor import platform
from hyper_adaptor.memory import GroupState, SwapError, SwapManager, swap, swap_tensor_wrapper, swap_wrapper, unwrap
from tests.unit.memory._models import batch, make_stack, step

LAYERS = 4


def wrap_all(stack, mgr, **kw):
    for i, layer in enumerate(stack):
        swap_wrapper(layer, manager=mgr, tag=i, **kw)


def test_swap_is_bitwise_exact():
    stack, x = make_stack(LAYERS), batch()
    ref_loss, ref_grads = step(stack, x)
    mgr = SwapManager(min_bytes=0)
    wrap_all(stack, mgr)
    for _ in range(2):  # the second step reuses the pooled host buffers
        loss, grads = step(stack, x)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert mgr.moved_bytes > 0 and mgr.moved_bytes == mgr.loaded_bytes
    for layer in stack:
        unwrap(layer)
    assert "forward" not in layer.__dict__


def test_between_forward_and_backward_saved_tensors_are_on_the_host_tier():
    stack, x = make_stack(LAYERS), batch()
    mgr = SwapManager(min_bytes=0)
    seen = []  # (layer, weak ref to the saved storage, its bytes) for every tensor the pack hook moved

    def record(t):
        seen.append((mgr.current_group.tag, StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        return True

    wrap_all(stack, mgr, policy_fn=record)

    def check():
        groups = {g.tag: g for g in mgr.groups()}
        assert [groups[i].state for i in range(LAYERS)] == [GroupState.OFFLOADED] * (LAYERS - 1) + [GroupState.CLOSED]
        for tag, weak, nbytes in seen:
            if tag == LAYERS - 1:  # the last layer is not swapped: still on the device
                assert not weak.expired()
            else:                  # the device storage was freed (nobody holds it any more) ...
                assert weak.expired(), f"layer {tag}: a swapped storage of {nbytes} bytes is still alive"
        for tag in range(LAYERS - 1):  # ... and its bytes are in separate host buffers
            for e in groups[tag].entries.values():
                assert e.storage is None and e.loaded is None
                assert e.host is not None and e.host.numel() == e.nbytes and mgr.pool.owns(e.host.data_ptr())
        stats = mgr.stats()
        moved = sum(e.nbytes for i in range(LAYERS - 1) for e in groups[i].entries.values())
        last = sum(e.nbytes for e in groups[LAYERS - 1].entries.values())
        assert stats["host_bytes"] == moved > 0
        assert stats["device_bytes"] == last
        assert stats["released_but_alive_bytes"] == 0

    step(stack, x, between=check)
    assert mgr.stats()["groups"] == 0 and mgr.stats()["device_bytes"] == 0  # all freed after backward


def test_host_copy_holds_the_saved_bytes():
    mgr = SwapManager(min_bytes=0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    saved = {}

    def keep_copy(t):
        saved[t.untyped_storage().data_ptr()] = t.detach().clone()
        return True

    y1 = swap(lambda a: torch.tanh(a @ w), x, manager=mgr, policy_fn=keep_copy)
    y2 = swap(lambda a: a * 2, y1, manager=mgr)
    (g,) = [g for g in mgr.groups() if g.state is GroupState.OFFLOADED]
    (entry,) = g.entries.values()
    # the saved tensor (tanh's output) is bit for bit in the host buffer
    original = saved[entry.key]
    assert torch.equal(entry.host.view(original.dtype).view(original.shape), original)
    y2.sum().backward()


def test_prefetch_loads_the_layer_before_while_the_current_one_computes():
    log = []
    stack, x = make_stack(LAYERS, log=log), batch()
    mgr = SwapManager(min_bytes=0, prefetch=1)
    mgr.trace = log  # the layers' backward marks go into the same ordered record
    wrap_all(stack, mgr)
    step(stack, x)
    at = {event: i for i, event in enumerate(log)}
    for i in range(1, LAYERS):
        # the load of layer i-1 is launched before layer i's backward computes ...
        assert at[("load", i - 1)] < at[("compute", i)], log
        # ... and not earlier than needed: after layer i+1 has computed (one group ahead)
        if i + 1 < LAYERS:
            assert at[("load", i - 1)] > at[("compute", i + 1)], log
        assert at[("wait", i - 1)] > at[("compute", i)], log
    assert ("load", LAYERS - 1) not in at  # the last layer was never moved


def test_without_prefetch_each_layer_loads_on_demand():
    log = []
    stack, x = make_stack(LAYERS, log=log), batch()
    mgr = SwapManager(min_bytes=0, prefetch=0)
    mgr.trace = log
    wrap_all(stack, mgr)
    step(stack, x)
    at = {event: i for i, event in enumerate(log)}
    for i in range(1, LAYERS):
        assert at[("load", i - 1)] > at[("compute", i)], log


def test_pool_buffers_are_reused_across_steps():
    stack, x = make_stack(LAYERS), batch()
    mgr = SwapManager(min_bytes=0)
    wrap_all(stack, mgr)
    buffers = []

    def host_ptrs():
        buffers.append(sorted(e.host.data_ptr() for g in mgr.groups() for e in g.entries.values()
                              if e.host is not None))

    step(stack, x, between=host_ptrs)
    allocated = mgr.pool.allocations
    step(stack, x, between=host_ptrs)
    assert buffers[0] and buffers[0] == buffers[1]  # the same host buffers, step after step
    assert mgr.pool.allocations == allocated
    assert mgr.pool.acquisitions == 2 * allocated


def test_views_of_one_storage_move_once_and_parameters_never():
    mgr = SwapManager(min_bytes=0)
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    weak = {}

    def fn(a):
        h = torch.nn.functional.linear(a, w)  # saves a and w.t() (a view of the parameter)
        weak["h"] = StorageWeakRef(h.untyped_storage())
        v1, v2 = h[:, :8], h.t()  # two views of h's storage ...
        return (v1.sin() * 2).sum() + (v2.cos()).sum()  # ... both saved (sin, cos)

    ref = fn(x * 1)
    ref.backward()
    ref_gx, ref_gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    out = swap(fn, x * 1, manager=mgr)
    tail = swap(lambda t: t * 1, out, manager=mgr)  # opens the next group: the first one moves
    g = next(g for g in mgr.groups() if g.state is GroupState.OFFLOADED)
    assert w.untyped_storage().data_ptr() not in g.entries and w.untyped_storage().nbytes() == 16 * 16 * 4
    # x*1 and h (one storage, saved twice as two views): two storages, each moved once, h's freed
    assert len(g.entries) == 2
    assert mgr.moved_bytes == 4 * 16 * 4 + 4 * 16 * 4
    assert weak["h"].expired()
    tail.backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, ref_gx) and torch.equal(w.grad, ref_gw)


def test_small_tensors_stay_on_the_device():
    mgr = SwapManager(min_bytes=1 << 20)
    stack, x = make_stack(2), batch()
    wrap_all(stack, mgr)

    def check():
        assert all(e.mode == "keep" for g in mgr.groups() for e in g.entries.values())
        assert mgr.moved_bytes == 0

    step(stack, x, between=check)


def test_swap_tensor_wrapper_moves_the_tensor_with_its_group():
    mgr = SwapManager(min_bytes=0)
    kept = torch.randn(64)
    expect = kept.clone()
    swap_tensor_wrapper(kept, "cache", manager=mgr)
    swap(lambda t: t * 2, torch.randn(4, requires_grad=True), manager=mgr)  # next group: "cache" moves
    assert kept.untyped_storage().nbytes() == 0
    mgr.ensure_loaded("cache")
    assert torch.equal(kept, expect)


def test_misuse_is_a_clear_error():
    mgr = SwapManager(min_bytes=0)
    x = torch.randn(4, 4, requires_grad=True)
    y = swap(torch.sin, x * 1, manager=mgr, tag="a")
    with pytest.raises(SwapError, match="no load was launched"):
        mgr.wait_load("a")
    with pytest.raises(SwapError, match="no offload was launched"):
        mgr.wait_offload("a")
    mgr.launch_offload("a")
    mgr.wait_offload("a")
    with pytest.raises(SwapError, match="no load was launched"):
        mgr.wait_load("a")
    mgr.launch_load("a")
    mgr.wait_load("a")
    y.sum().backward()
    with pytest.raises(SwapError, match=r"group_swap=True\) needs an open swap group"):
        swap(torch.sin, x, manager=mgr, group_swap=True)
    with mgr.group("open") as g:
        with pytest.raises(SwapError, match="still open"):
            mgr.launch_offload(g)
    with pytest.raises(SwapError, match="no live swap group"):
        mgr.launch_load("nope")
    with pytest.raises(ValueError, match="prefetch"):
        SwapManager(prefetch=-1)
    with pytest.raises(ValueError, match="min_bytes"):
        SwapManager(min_bytes=-1)


def test_group_swap_joins_the_enclosing_group():
    mgr = SwapManager(min_bytes=0)
    x = torch.randn(4, 8, requires_grad=True)
    with mgr.group("layer") as g:
        y = swap(torch.sin, x * 1, manager=mgr, group_swap=True)
        z = swap(torch.cos, y, manager=mgr, group_swap=True)
    assert [gr.tag for gr in mgr.groups()] == ["layer"] and len(g.entries) == 2
    z.sum().backward()


def test_cpu_streams_are_synchronous_stand_ins():
    if platform.device_type() != "cpu":
        pytest.skip("cpu stand-ins only")
    s = platform.copy_stream()
    e = platform.new_event()
    with platform.use_stream(s):
        e.record(s)
    assert e.query() and not platform.copies_are_async() and not platform.pin_memory_available()
    assert platform.host_buffer(10).numel() == 10


@pytest.mark.parametrize("bad", [0, -1, 1.5, "1"])
def test_bad_offloads_in_flight_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="offloads_in_flight"):
        SwapManager(offloads_in_flight=bad)
