"""Expert overlap without a process group: argument errors of overlapped_moe_forward, and the
HookCoordinator / CommComputeOverlap machinery on threads (pairing, ordering, errors, worker reuse)."""

import threading
import time

import pytest
import torch

from hyper_adaptor.parallel.expert import CommComputeOverlap, HookCoordinator, HookRole, overlapped_moe_forward


def _args(tokens=4, experts=4):
    x = torch.randn(tokens, 3)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool)
    routing_map[:, 0] = True
    return x, routing_map, routing_map.float()


@pytest.mark.parametrize("chunks", [0, -1, 1.5, True, "2", None])
def test_bad_chunks(chunks):
    with pytest.raises(ValueError, match="chunks must be an integer >= 1"):
        overlapped_moe_forward(*_args(), lambda x, n: x, ep_group=None, chunks=chunks)


def test_bad_callables_and_shapes():
    x, routing_map, probs = _args()
    with pytest.raises(TypeError, match="experts_fn must be callable"):
        overlapped_moe_forward(x, routing_map, probs, None, ep_group=None)
    with pytest.raises(TypeError, match="shared_fn must be callable"):
        overlapped_moe_forward(x, routing_map, probs, lambda x, n: x, ep_group=None, shared_fn=3)
    with pytest.raises(ValueError, match="routing_map must be bool"):
        overlapped_moe_forward(x, probs, probs, lambda x, n: x, ep_group=None)
    with pytest.raises(ValueError, match=r"tokens \[T, H\] and routing_map \[T, E\]"):
        overlapped_moe_forward(x[:3], routing_map, probs, lambda x, n: x, ep_group=None)
    with pytest.raises(ValueError, match="probs"):
        overlapped_moe_forward(x, routing_map, probs[:, :2], lambda x, n: x, ep_group=None)


def test_coordinator_argument_errors():
    with pytest.raises(ValueError, match="timeout"):
        HookCoordinator(timeout=0)
    c = HookCoordinator()
    with pytest.raises(TypeError, match="HookRole"):
        c.rendezvous("comm")
    c.rendezvous(HookRole.COMM)  # disabled: returns at once
    with pytest.raises(TypeError, match="wrap only a callable|can only wrap a callable"):
        CommComputeOverlap().wrap_dispatch(3)
    with pytest.raises(TypeError, match="fwd_fn and bwd_fn"):
        CommComputeOverlap().run(None, lambda: None)


def _two_sides(coordinator, fwd_roles, bwd_roles, log):
    def side(name, roles):
        for i, role in enumerate(roles):
            coordinator.rendezvous(role, side=name)
            if name == "backward":
                time.sleep(0.02)  # the backward is the quicker one to issue, unless held back
            log.append((name, i))
        coordinator.depart()

    coordinator.enable()
    threads = [threading.Thread(target=side, args=("forward", fwd_roles)),
               threading.Thread(target=side, args=("backward", bwd_roles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    coordinator.disable()


def _slow_forward(coordinator: HookCoordinator) -> HookCoordinator:
    """The coordinator with its forward side sleeping after each rendezvous."""
    rendezvous = coordinator.rendezvous

    def slow_forward(role, side=None):
        rendezvous(role, side)
        if side == "forward":
            time.sleep(0.2)

    coordinator.rendezvous = slow_forward
    return coordinator


def test_two_comm_segments_run_forward_first():
    # the forward sleeps after its rendezvous: without the hold the backward would log first
    c, log = _slow_forward(HookCoordinator(timeout=10)), []
    _two_sides(c, [HookRole.COMM, HookRole.COMPUTE], [HookRole.COMM, HookRole.COMPUTE], log)
    assert c.pairs == 2
    assert log.index(("forward", 0)) < log.index(("backward", 0))


def test_comm_and_compute_do_not_wait_for_each_other():
    c, log = _slow_forward(HookCoordinator(timeout=10)), []
    _two_sides(c, [HookRole.COMM], [HookRole.COMPUTE], log)
    assert c.pairs == 1 and log[0] == ("backward", 0)


def test_a_missing_partner_times_out():
    c = HookCoordinator(timeout=0.2)
    c.enable()
    with pytest.raises(TimeoutError, match="partner"):
        c.rendezvous(HookRole.COMM, side="forward")


def test_departed_partner_runs_solo():
    c = HookCoordinator(timeout=0.2)
    c.enable()
    c.depart()
    c.rendezvous(HookRole.COMM, side="forward")  # no partner, no wait, no error


def _model(seed, overlap):
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(3, 3, generator=g).requires_grad_() for _ in range(3)]
    dispatch = lambda t: t @ w[0]  # noqa: E731
    combine = lambda t: t @ w[2]  # noqa: E731
    if overlap is not None:
        dispatch, combine = overlap.wrap_dispatch(dispatch), overlap.wrap_combine(combine, is_last_layer=True)

    def loss(m):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(m)).requires_grad_()
        return combine(torch.tanh(dispatch(x) @ w[1])).pow(2).sum()

    return w, loss


def test_run_equals_sequential_and_pairs_every_hook():
    w_seq, loss_seq = _model(0, None)
    l0 = loss_seq(0)
    l0.backward()
    l1 = loss_seq(1)
    l1.backward()

    overlap = CommComputeOverlap(timeout=10)
    w_ov, loss_ov = _model(0, overlap)
    m0 = loss_ov(0)  # outside run: the hooks are identities
    m1 = overlap.run(lambda: loss_ov(1), m0.backward)
    assert overlap.coordinator.pairs == 3  # A-C, B-B, C-A
    m1.backward()
    overlap.close()
    assert torch.equal(l0, m0) and torch.equal(l1, m1)
    for a, b in zip(w_seq, w_ov):
        assert torch.equal(a.grad, b.grad)


def test_worker_is_reused_and_errors_come_back():
    overlap = CommComputeOverlap(timeout=5)
    ids = []
    for _ in range(3):
        assert overlap.run(lambda: 7, lambda: ids.append(threading.get_ident())) == 7
    assert len(set(ids)) == 1 and ids[0] != threading.get_ident()

    def boom():
        raise ValueError("bwd failed")

    with pytest.raises(RuntimeError, match="backward function raised") as info:
        overlap.run(lambda: None, boom)
    assert isinstance(info.value.__cause__, ValueError)

    done = []
    with pytest.raises(KeyError):
        overlap.run(lambda: {}["missing"], lambda: done.append(1))
    assert done == [1]  # the backward side still ran to its end
    assert overlap.run(lambda: 1, lambda: ids.append(threading.get_ident())) == 1
    assert len(set(ids)) == 1
    overlap.close()


def test_pipeline_runtime_refuses_a_pair_runner_without_run():
    from hyper_adaptor.parallel.pipeline import StageLayout
    from hyper_adaptor.parallel.pipeline.runtime import execute

    with pytest.raises(TypeError, match="comm_compute_overlap must have a run"):
        execute([], {}, StageLayout(1), comm_compute_overlap=object())


def test_measure_refuses_no_steps():
    from hyper_adaptor.parallel.expert import measure_exposed_comm

    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        measure_exposed_comm(*_args(), lambda x, n: x, ep_group=None, steps=0)


def test_nested_run_is_refused():
    overlap = CommComputeOverlap(timeout=5)
    with pytest.raises(RuntimeError, match="cannot be called from inside"):
        overlap.run(lambda: overlap.run(lambda: None, lambda: None), lambda: None)
    with pytest.raises(RuntimeError, match="backward function raised") as info:
        overlap.run(lambda: None, lambda: overlap.run(lambda: None, lambda: None))
    assert "cannot be called from inside" in str(info.value.__cause__)
    assert overlap.run(lambda: 5, lambda: None) == 5
    overlap.close()
