"""The expert-parallel engine's local pieces against naive loops: permute / unpermute (with capacity and
padding), the by-source <-> by-expert reordering, the send splits, and the one-process dispatcher;
their gradients, and the errors bad input gets."""

from __future__ import annotations

import pytest
import torch

from hyper_adaptor.parallel.expert import (
    AllToAllDispatcher,
    capacity,
    capacity_mask,
    chunk_order,
    experts_per_rank,
    permute,
    reorder,
    send_splits,
    unpermute,
)

T, E, H, K = 11, 5, 3, 2


def routed(seed=0, tokens=T, experts=E, topk=K, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen, dtype=dtype)
    scores = torch.rand(tokens, experts, generator=gen, dtype=dtype)
    chosen = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(-1, chosen, True)
    return x, routing_map, scores * routing_map


def naive_permute(x, routing_map):
    rows, counts = [], []
    for e in range(routing_map.shape[1]):
        ids = [t for t in range(routing_map.shape[0]) if routing_map[t, e]]
        rows += [x[t] for t in ids]
        counts.append(len(ids))
    return torch.stack(rows), counts


def naive_unpermute(out, routing_map, probs):
    result = torch.zeros(routing_map.shape[0], out.shape[1], dtype=out.dtype)
    row = 0
    for e in range(routing_map.shape[1]):
        for t in range(routing_map.shape[0]):
            if routing_map[t, e]:
                result[t] += out[row] * probs[t, e]
                row += 1
    return result


def test_permute_is_expert_major_in_token_order():
    x, routing_map, probs = routed()
    rows, perm = permute(x, routing_map, probs)
    want, counts = naive_permute(x, routing_map)
    assert torch.equal(rows, want) and perm.tokens_per_expert == counts and perm.num_tokens == T


def test_unpermute_sums_each_tokens_copies_times_its_probability():
    x, routing_map, probs = routed(1)
    rows, perm = permute(x, routing_map, probs)
    out = rows * 3 + 1                      # stand-in for the experts
    assert torch.allclose(unpermute(out, perm), naive_unpermute(out, routing_map, probs))
    assert torch.allclose(unpermute(out, perm, weighted=False), naive_unpermute(out, routing_map, routing_map.float()))


def test_padding_gives_every_expert_pad_to_rows_and_unpermute_drops_them():
    x, routing_map, probs = routed(2)
    cap = int(routing_map.sum(0).max())
    rows, perm = permute(x, routing_map, probs, pad_to=cap + 2)
    assert perm.tokens_per_expert == [cap + 2] * E and rows.shape == (E * (cap + 2), H)
    want, counts = naive_permute(x, routing_map)
    for e, block in enumerate(rows.split(cap + 2)):
        start = sum(counts[:e])
        assert torch.equal(block[:counts[e]], want[start:start + counts[e]])
        assert not block[counts[e]:].any()
    out = rows + 5                          # padding rows turn non-zero: unpermute must still drop them
    assert torch.allclose(unpermute(out, perm), naive_unpermute(naive_permute(x, routing_map)[0] + 5, routing_map,
                                                                 probs))


def test_capacity_is_ceil_of_the_even_share_times_the_factor():
    assert capacity(10, 4, 2, 1.0) == 5
    assert capacity(10, 4, 2, 1.1) == 6
    assert capacity(3, 8, 1, 0.5) == 1
    with pytest.raises(ValueError, match="capacity factor"):
        capacity(10, 4, 2, 0)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_mask_keeps_the_most_probable_or_earliest_copies(policy):
    x, routing_map, probs = routed(3, tokens=20)
    cap = 3
    kept = capacity_mask(routing_map, probs, cap, policy)
    for e in range(E):
        ids = [t for t in range(20) if routing_map[t, e]]
        if policy == "probs":
            ids = sorted(ids, key=lambda t: (-probs[t, e].item(), t))
        assert set(torch.nonzero(kept[:, e]).flatten().tolist()) == set(ids[:cap])
    with pytest.raises(ValueError, match="drop policy"):
        capacity_mask(routing_map, probs, cap, "random")


def test_capacity_mask_breaks_ties_by_token_order():
    routing_map = torch.ones(4, 1, dtype=torch.bool)
    kept = capacity_mask(routing_map, torch.full((4, 1), 0.5), 2, "probs")
    assert kept[:, 0].tolist() == [True, True, False, False]


def test_permute_and_unpermute_gradients():
    x, routing_map, probs = routed(4, dtype=torch.float64)
    weight = torch.randn(H, H, dtype=torch.float64)

    def f(tokens, p):
        rows, perm = permute(tokens, routing_map, p, pad_to=int(routing_map.sum(0).max()) + 1)
        return unpermute(torch.tanh(rows @ weight), perm)

    assert torch.autograd.gradcheck(f, (x.requires_grad_(), probs.requires_grad_()))


@pytest.mark.parametrize("pad_to", [None, 9])
def test_unpermute_keeps_only_the_row_indices_for_its_backward(pad_to):
    # torch's index_add keeps its whole [N, H] source for the backward; the combine needs only the rows'
    # token indices (and, weighted, the rows once, for the probabilities' gradient)
    x, routing_map, probs = routed(seed=4)
    rows, perm = permute(x, routing_map, probs, pad_to=pad_to)
    for weighted, floats_kept in ((False, 0), (True, 1)):
        expert_out = (rows * 2).requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = unpermute(expert_out, perm, weighted=weighted)
        big = [t for t in saved if t.is_floating_point() and t.dim() == 2]
        assert len(big) == floats_kept, [tuple(t.shape) for t in big]
        grad = torch.randn(out.shape)
        out.backward(grad)
        scale = perm.probs[:, None] if weighted else 1.0
        padded_grad = torch.cat([grad, torch.zeros(1, H)])   # a padding row (index T) gets zero
        assert torch.equal(expert_out.grad, padded_grad[perm.rows] * scale)


def test_weighted_combine_peaks_at_least_one_row_buffer_below_autograds():
    # autograd's rows * probs then index_add holds the weighted [N, H] copy for the backward and makes an
    # [N, H] product there for the probabilities' gradient; the hand-written combine keeps neither
    from torch.distributed._tools.mem_tracker import MemTracker

    tokens, hidden = 256, 64
    _, routing_map, probs = routed(seed=7, tokens=tokens, experts=8, topk=4)
    rows, perm = permute(torch.randn(tokens, hidden), routing_map, probs)
    perm.probs.requires_grad_()   # the router's probabilities get a gradient too
    grad = torch.randn(tokens, hidden)

    def peak(combine):
        leaf = rows.detach().requires_grad_()
        tracker = MemTracker()
        with tracker:
            combine(leaf).backward(grad)
        return sum(tracker.get_tracker_snapshot("peak")[torch.device("cpu")].values()), leaf.grad

    def autograds(leaf):
        weighted = leaf * perm.probs[:, None]
        return leaf.new_zeros(tokens, hidden).index_add(0, perm.rows, weighted)

    engine_peak, engine_grad = peak(lambda leaf: unpermute(leaf, perm))
    autograd_peak, autograd_grad = peak(autograds)
    assert torch.allclose(engine_grad, autograd_grad)
    assert engine_peak <= autograd_peak - rows.numel() * 4, (engine_peak, autograd_peak)


def test_permute_and_unpermute_reject_bad_input():
    x, routing_map, probs = routed()
    with pytest.raises(ValueError, match="must be bool"):
        permute(x, routing_map.float(), probs)
    with pytest.raises(ValueError, match=r"tokens \[T, H\] and routing_map"):
        permute(x[:-1], routing_map, probs)
    with pytest.raises(ValueError, match="pad_to"):
        permute(x, routing_map, probs, pad_to=1)
    rows, perm = permute(x, routing_map, probs)
    with pytest.raises(ValueError, match="unpermute"):
        unpermute(rows[:-1], perm)


# ------------------------------------------------------------------------------ the exchange layout
def test_send_splits_and_the_even_split():
    assert experts_per_rank(8, 4) == [2, 2, 2, 2]
    assert send_splits([1, 2, 3, 4, 5], [2, 3]) == [3, 12]
    assert send_splits([1, 2, 3, 4, 5], [0, 5]) == [0, 15]
    with pytest.raises(ValueError, match="cannot be split evenly"):
        experts_per_rank(6, 4)
    with pytest.raises(ValueError, match="does not cover"):
        send_splits([1, 2, 3], [1, 1])


def test_chunk_order_groups_received_rows_by_expert_then_source():
    received = torch.tensor([[2, 0, 1], [1, 3, 0], [0, 2, 2]])    # [source, local expert]
    labels = [(s, e) for s in range(3) for e in range(3) for _ in range(int(received[s, e]))]
    x = torch.arange(len(labels), dtype=torch.float32)[:, None]
    index, per_expert = chunk_order(received)
    assert per_expert == [3, 5, 3]
    got = [labels[int(i)] for i in reorder(x, index)[:, 0].long()]
    assert got == sorted(labels, key=lambda se: (se[1], se[0]))


def test_reorder_gradient_is_the_inverse_reordering():
    x = torch.randn(7, 2, dtype=torch.float64, requires_grad=True)
    index = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    assert torch.autograd.gradcheck(lambda t: reorder(t, index), (x,))


# ------------------------------------------------------------------------------ one-process dispatcher
@pytest.mark.parametrize("options", [{}, dict(capacity_factor=1.0), dict(capacity_factor=1.0, pad_to_capacity=True),
                                     dict(capacity_factor=0.8, drop_policy="position")])
def test_one_process_dispatcher_is_permute_then_unpermute(options):
    x, routing_map, probs = routed(5, tokens=16)
    d = AllToAllDispatcher(E, None, topk=K, **options)
    rows, counts = d.dispatch(x.requires_grad_(), routing_map, probs)
    # one rank: the permuted rows are the experts' input as they are, no reordering copy of them
    assert type(rows.grad_fn).__name__ != "_ReorderBackward"
    out = d.combine(rows * 2)
    kept, pad_to = routing_map, None
    if "capacity_factor" in options:
        cap = capacity(16, E, K, options["capacity_factor"])
        kept = capacity_mask(routing_map, probs, cap, options.get("drop_policy", "probs"))
        pad_to = cap if options.get("pad_to_capacity") else None
    want_rows, perm = permute(x, kept, probs, pad_to=pad_to)
    assert torch.equal(rows, want_rows) and counts == perm.tokens_per_expert
    with torch.no_grad():
        assert torch.allclose(out, naive_unpermute(naive_permute(x, kept)[0] * 2, kept, probs))


def test_dispatcher_reads_topk_from_the_routing_map_when_not_given():
    x, routing_map, probs = routed(6, tokens=16)
    a, b = AllToAllDispatcher(E, capacity_factor=1.0), AllToAllDispatcher(E, capacity_factor=1.0, topk=K)
    assert a.dispatch(x, routing_map, probs)[1] == b.dispatch(x, routing_map, probs)[1]


def test_dispatcher_rejects_bad_options_and_misuse():
    with pytest.raises(ValueError, match="pad_to_capacity=True needs a capacity_factor"):
        AllToAllDispatcher(E, pad_to_capacity=True)
    with pytest.raises(ValueError, match="drop_policy"):
        AllToAllDispatcher(E, capacity_factor=1.0, drop_policy="random")
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        AllToAllDispatcher(E, capacity_factor=0.0)
    with pytest.raises(ValueError, match="placement"):
        AllToAllDispatcher(E, placement=[E - 1])
    with pytest.raises(ValueError, match="topk"):
        AllToAllDispatcher(E, topk=E + 1)
    d = AllToAllDispatcher(E)
    x, routing_map, probs = routed()
    with pytest.raises(ValueError, match="routing_map"):
        d.dispatch(x, routing_map[:, :-1], probs[:, :-1])
    with pytest.raises(ValueError, match="probs"):
        d.dispatch(x, routing_map, probs[:-1])
    with pytest.raises(RuntimeError, match="without a dispatch"):
        d.combine(x)
    rows, _ = d.dispatch(x, routing_map, probs)
    with pytest.raises(RuntimeError, match="twice"):
        d.dispatch(x, routing_map, probs)
    with pytest.raises(ValueError, match="combine: expected"):
        d.combine(rows[:-1])


def test_expert_order_skips_the_copy_where_rows_are_in_expert_order_already():
    from hyper_adaptor.parallel.expert._comm import expert_order

    x = torch.randn(7, H)
    for received in (torch.tensor([[3, 4]]), torch.tensor([[3], [4]])):   # one source; one local expert
        index, per_expert = expert_order(received)
        assert index is None and per_expert == received.sum(dim=0).tolist()
        assert reorder(x, index) is x
    index, per_expert = expert_order(torch.tensor([[1, 2], [3, 1]]))
    assert torch.equal(index, chunk_order(torch.tensor([[1, 2], [3, 1]]))[0]) and per_expert == [4, 3]
