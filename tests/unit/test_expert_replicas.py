"""Hot-expert replicas (hyper_adaptor.parallel.expert._replicas), one process: the plan (deterministic,
never a replica on the owner, slots ordered by rank), the routing over slots (every routed copy in
exactly one slot of its expert, the split contiguous and by the plan's weights), the uneven placement
giving the same MoE output as the plain one, the Zipf-skewed load brought to max/mean <= 1.1, and bad
input refused by name. The gradient reduction and weight refresh run on 4 gloo ranks in
tests/distributed/test_expert_replicas.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from hyper_adaptor.parallel.expert import MoE, attach_replicas, permute, send_splits, unpermute
from hyper_adaptor.parallel.expert._replicas import (
    HotExpertReplicas,
    _water_fill,
    identity_plan,
    imbalance,
    plan_replicas,
    rank_loads,
    route_to_slots,
    skewed_load_report,
    skewed_routing,
)

LAYOUTS = [(8, 4, 1), (8, 4, 2), (8, 4, 4), (8, 4, 9), (8, 2, 3), (16, 4, 6), (6, 3, 5)]  # (E, P, R)


def _counts(num_experts, seed):
    g = torch.Generator().manual_seed(seed)
    skew = torch.rand(num_experts, generator=g) ** 3     # a few hot experts, in random positions
    return (skew * 10_000).long().tolist()


@pytest.mark.parametrize("experts,ranks,replicas", LAYOUTS)
def test_plan_shape_and_rules(experts, ranks, replicas):
    for seed in range(20):
        counts = _counts(experts, seed)
        plan = plan_replicas(counts, ranks, replicas)
        per_rank = experts // ranks
        assert plan.num_slots == experts + replicas and sum(plan.placement) == plan.num_slots
        assert sorted(set(plan.slot_expert)) == list(range(experts))
        start = 0
        for d, count in enumerate(plan.placement):
            slots = plan.slot_expert[start:start + count]
            # first the rank's own experts in order, then its replicas in expert order
            assert list(slots[:per_rank]) == list(range(d * per_rank, (d + 1) * per_rank))
            assert list(slots[per_rank:]) == sorted(slots[per_rank:]) == plan.local_replicas(d)
            assert len(set(slots)) == len(slots), f"two copies of an expert on rank {d}"
            start += count
        for e, slots in enumerate(plan.copies):
            assert all(plan.slot_expert[s] == e for s in slots)
            assert plan.slot_rank(slots[0]) == plan.owner(e)
            assert all(plan.slot_rank(s) != plan.owner(e) for s in slots[1:]), "a replica on its owner"
            assert len(plan.weights[e]) == len(slots) and all(w >= 0 for w in plan.weights[e])
            if counts[e] and len(slots) > 1:
                assert sum(plan.weights[e]) == counts[e]
        assert imbalance(plan.expected_load()) <= imbalance(plan.owner_load()) + 1e-12


@pytest.mark.parametrize("experts,ranks,replicas", LAYOUTS)
def test_plan_is_deterministic(experts, ranks, replicas):
    counts = _counts(experts, 7)
    first = plan_replicas(counts, ranks, replicas)
    assert plan_replicas(list(counts), ranks, replicas) == first
    assert plan_replicas(torch.tensor(counts), ranks, replicas) == first


def test_most_loaded_experts_get_replicas_on_least_loaded_ranks():
    # rank 0 owns the two hot experts; rank 3 the coldest pair, rank 2 the next
    counts = [900, 700, 300, 300, 100, 100, 10, 10]
    plan = plan_replicas(counts, 4, 2)
    assert [(e, d) for _, e, d in plan.replicas()] == [(0, 3), (1, 2)]
    assert plan.placement == (2, 2, 3, 3)
    # no replicas: the even placement, each expert whole on its owner
    assert plan_replicas(counts, 4, 0) == identity_plan(8, 4, counts)


def test_water_fill_levels_the_lowest_bins():
    assert _water_fill(10.0, [0.0, 5.0, 20.0]) == [7.5, 2.5, 0.0]
    assert _water_fill(3.0, [4.0, 0.0]) == [0.0, 3.0]
    assert _water_fill(0.0, [1.0, 1.0]) == [0.0, 0.0]


def _skewed_plan(replicas=3):
    # exponent 2: expert 0 is hot enough for two replicas
    report = skewed_load_report(replicas=replicas, exponent=2.0, tokens_per_rank=512, window=2, steps=1)
    plan = plan_replicas(report["tokens_per_expert"], 4, replicas)
    assert len(plan.copies[0]) == 3
    return plan


def test_route_sends_every_copy_to_exactly_one_slot_of_its_expert():
    plan = _skewed_plan()
    g = torch.Generator().manual_seed(1)
    routing_map = skewed_routing(301, 8, 2, 2.0, g)
    probs = torch.softmax(torch.randn(301, 8, generator=g), 1) * routing_map
    slot_map, slot_probs = route_to_slots(plan, routing_map, probs)
    assert slot_map.shape == (301, plan.num_slots) and slot_map.dtype == torch.bool
    # fold the slots back onto their experts: every routed copy exactly once
    slot_expert = torch.tensor(plan.slot_expert)
    folded = torch.zeros(301, 8, dtype=torch.long).index_add_(1, slot_expert, slot_map.long())
    assert torch.equal(folded, routing_map.long())
    assert torch.equal(slot_probs, torch.where(slot_map, probs[:, slot_expert], 0.0))
    # the split: contiguous pieces in token order, owner first, sized n * W_k // W
    for e, (slots, weights) in enumerate(zip(plan.copies, plan.weights)):
        tokens = routing_map[:, e].nonzero().flatten()
        n, total = len(tokens), sum(weights)
        bounds = [0] + [n * sum(weights[:k + 1]) // total for k in range(len(weights) - 1)] + [n]
        for k, slot in enumerate(slots):
            assert torch.equal(slot_map[:, slot].nonzero().flatten(), tokens[bounds[k]:bounds[k + 1]])
    # deterministic
    again = route_to_slots(plan, routing_map.clone(), probs.clone())
    assert torch.equal(again[0], slot_map) and torch.equal(again[1], slot_probs)


def test_route_keeps_the_router_gradient():
    plan = _skewed_plan()
    g = torch.Generator().manual_seed(2)
    routing_map = skewed_routing(64, 8, 2, 2.0, g)
    logits = torch.randn(64, 8, generator=g, requires_grad=True)
    weight = torch.randn(64, plan.num_slots, generator=g)
    slot_probs = route_to_slots(plan, routing_map, torch.softmax(logits, 1) * routing_map)[1]
    (slot_probs * weight).sum().backward()
    want_logits = logits.detach().clone().requires_grad_()
    # the same weight seen per expert: slot weights of each token's chosen slot
    slot_map = route_to_slots(plan, routing_map)[0]
    per_expert = torch.zeros(64, 8).index_add_(1, torch.tensor(plan.slot_expert), weight * slot_map)
    (torch.softmax(want_logits, 1) * routing_map * per_expert).sum().backward()
    torch.testing.assert_close(logits.grad, want_logits.grad, rtol=0, atol=1e-7)


def _moe_out(tokens, routing_map, probs, w1, w2, slot_expert=None):
    rows, perm = permute(tokens, routing_map, probs)
    pieces, start = [], 0
    for slot, count in enumerate(perm.tokens_per_expert):
        e = slot if slot_expert is None else slot_expert[slot]
        x = rows[start:start + count]
        pieces.append(torch.nn.functional.gelu(x @ w1[e]) @ w2[e])
        start += count
    return unpermute(torch.cat(pieces), perm)


def test_uneven_placement_gives_the_plain_output_and_the_planned_rows():
    """Four source ranks routed over the slots: the MoE output equals the one without replicas, and
    the rows each destination rank receives (send_splits with the uneven placement) are the plan's."""
    plan = _skewed_plan()
    g = torch.Generator().manual_seed(3)
    w1, w2 = torch.randn(8, 6, 10, generator=g), torch.randn(8, 10, 6, generator=g)
    received, plain_received = [0] * 4, [0] * 4
    for _ in range(4):
        tokens = torch.randn(97, 6, generator=g)
        routing_map = skewed_routing(97, 8, 2, 2.0, g)
        probs = torch.softmax(torch.randn(97, 8, generator=g), 1) * routing_map
        plain = _moe_out(tokens, routing_map, probs, w1, w2)
        slot_map, slot_probs = route_to_slots(plan, routing_map, probs)
        replicated = _moe_out(tokens, slot_map, slot_probs, w1, w2, plan.slot_expert)
        torch.testing.assert_close(replicated, plain, rtol=0, atol=1e-5)
        splits = send_splits(slot_map.sum(0).tolist(), list(plan.placement))
        assert splits == rank_loads(slot_map.sum(0), plan.placement)
        received = [a + b for a, b in zip(received, splits)]
        plain_received = [a + b for a, b in zip(plain_received, send_splits(routing_map.sum(0).tolist(), [2] * 4))]
    assert sum(received) == sum(plain_received) == 4 * 97 * 2
    assert imbalance(received) < 1.2 < 2.5 < imbalance(plain_received)


def test_zipf_skewed_router_reaches_1_1_with_replicas():
    """4 ranks, 8 experts, top-2, Zipf exponent 1: the hot experts all on rank 0 put max/mean tokens per
    rank far above 1.1; two replicas planned from 4 steps of counts bring the next 4 steps' load to
    <= 1.1, and more replicas closer to 1."""
    without = skewed_load_report(replicas=0, tokens_per_rank=1024)
    assert without["max_over_mean_before"] == without["max_over_mean_after"] > 2.0
    one = skewed_load_report(replicas=1, tokens_per_rank=1024)
    assert one["max_over_mean_after"] > 1.1          # one replica is not enough here
    for replicas in (2, 4):
        report = skewed_load_report(replicas=replicas, tokens_per_rank=1024)
        assert report["max_over_mean_before"] > 2.0
        assert report["max_over_mean_after"] <= 1.1, report
        assert sum(report["load_after"]) == sum(report["load_before"])
    assert skewed_load_report(replicas=4, tokens_per_rank=1024)["max_over_mean_after"] <= 1.02


def test_manager_on_one_process_plans_from_its_window():
    mgr = HotExpertReplicas(4, None, replicas=0, interval=2)
    assert mgr.placement == [4] and mgr.num_slots == 4
    assert mgr.load_report()["before"] == [0]
    routing_map = torch.tensor([[True, False, True, False]] * 3)
    for step in range(2):
        mgr.observe(routing_map.sum(0))
        assert torch.equal(mgr.route(routing_map)[0], routing_map)
        assert mgr.step() is (step == 1)
    assert mgr.plan.tokens_per_expert == (6, 0, 6, 0)
    report = mgr.load_report()
    assert report["before"] == report["after"] == [12] and report["planned"] == [12.0]
    assert report["before_max_over_mean"] == 1.0 and report["replicas"] == []
    # a new window: the counts start again
    mgr.observe([1, 0, 0, 0])
    mgr.replan()
    assert mgr.plan.tokens_per_expert == (1, 0, 0, 0) and mgr.load_report()["after"] == [1]


@pytest.mark.parametrize("kwargs,message", [
    (dict(replicas=-1), "hot-expert replicas must be an integer >= 0, got -1"),
    (dict(replicas=True), "hot-expert replicas must be an integer >= 0, got True"),
    (dict(replicas=1), "hot-expert replicas=1: at most 0 with 8 experts on 1 expert-parallel ranks"),
    (dict(interval=0), "replica interval must be an integer >= 1 step, got 0"),
    (dict(interval=2.5), "replica interval must be an integer >= 1 step, got 2.5"),
])
def test_manager_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        HotExpertReplicas(8, None, **{"replicas": 0, **kwargs})


def test_attach_refuses_what_is_not_a_moe_block():
    with pytest.raises(TypeError, match="attach_replicas applies to a MoE block, got Linear"):
        attach_replicas(torch.nn.Linear(2, 2), replicas=1, interval=1)


@pytest.mark.parametrize("call,message", [
    (lambda: plan_replicas([1] * 8, 4, 25), "hot-expert replicas=25: at most 24 with 8 experts on 4"),
    (lambda: plan_replicas([1] * 6, 4, 1), "6 experts cannot be split evenly over an expert-parallel group of 4"),
    (lambda: plan_replicas([1, -1], 2, 1), "token counts per expert must be >= 0"),
    (lambda: route_to_slots(identity_plan(8, 4), torch.zeros(3, 6, dtype=torch.bool)),
     r"routing_map \[T, 8\] expected"),
    (lambda: route_to_slots(identity_plan(8, 4), torch.zeros(3, 8)), "routing_map must be bool"),
    (lambda: route_to_slots(identity_plan(8, 4), torch.zeros(3, 8, dtype=torch.bool), torch.zeros(3, 7)), "probs"),
    (lambda: HotExpertReplicas(4, None, replicas=0).observe([1, 2]), "4 token counts expected, got 2"),
    (lambda: HotExpertReplicas(4, None, replicas=0).sync_weights([torch.zeros(3, 2)]),
     r"expert parameters must be \[4, ...\]"),
    (lambda: HotExpertReplicas(4, None, replicas=0).reduce_grads(), "pass the expert parameters"),
    (lambda: attach_replicas(MoE(4, 8, 4, 2, capacity_factor=1.0), replicas=1, interval=1),
     "hot-expert replicas need dropless dispatch; the block has capacity_factor=1.0"),
    (lambda: attach_replicas(MoE(4, 8, 4, 2), replicas=1, interval=1), "the block is not expert-parallel"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_every_small_layout_plans_up_to_the_limit():
    for experts, ranks in [(2, 2), (4, 2), (4, 4), (6, 3)]:
        for replicas in range(experts * (ranks - 1) + 1):
            for counts in itertools.islice(itertools.product([0, 3, 50], repeat=experts), 0, None, 23):
                plan = plan_replicas(list(counts), ranks, replicas)
                assert all(len(set(plan.slot_rank(s) for s in slots)) == len(slots) for slots in plan.copies)


def test_route_with_no_tokens_or_none_for_a_replicated_expert():
    plan = _skewed_plan()
    empty, probs = route_to_slots(plan, torch.zeros(0, 8, dtype=torch.bool), torch.zeros(0, 8))
    assert empty.shape == (0, plan.num_slots) and probs.shape == (0, plan.num_slots)
    routing_map = torch.zeros(5, 8, dtype=torch.bool)
    routing_map[:, 7] = True                      # expert 0 (replicated) gets nothing from this source
    slot_map = route_to_slots(plan, routing_map)[0]
    assert slot_map.sum() == 5 and slot_map[:, plan.copies[7][0]].all()
