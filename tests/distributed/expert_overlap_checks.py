"""Overlap checks, run inside a gloo world (hyper_adaptor/testing/world.py).

Every rank builds the same seeded experts (SwiGLU, E of them, ``placement`` split over the ranks), an
optional shared expert and a router, and its own tokens (a different count per rank, so chunks and
exchanges are uneven). ``overlap_checks`` returns, per rank, {check: [failure messages]} (empty = passed)
plus the largest differences measured, for the record:

- the plain path (``overlap=False``, one chunk) against a single-process float64 reference of the whole
  MoE (every rank's tokens, every expert, no communication): outputs and gradients within 1e-5;
- ``overlap=True`` against ``overlap=False`` at the same chunk count: bitwise (the same arithmetic, only
  launches and waits move);
- with 4 chunks two or more exchanges are in flight at once in the forward and in the backward, never
  more than one without overlap;
- 2, 3, 4 and more chunks than tokens against one chunk: within 1e-6 (the experts' GEMMs see fewer rows
  and weight gradients are summed chunk by chunk);
- a forward that reads an exchange before waiting for it (one rank late to send) gives a different result:
  the comparison can fail;
- ``CommComputeOverlap.run(fwd of micro-batch 1, bwd of micro-batch 0)`` against running them one after
  the other, one and two MoE layers: losses and gradients bitwise, every hook paired;
- the engine's ``MoE`` block (``ExpertParallel``, with and without a capacity) through
  ``moe_forward_overlapped``: one chunk bitwise its own forward, more chunks within 1e-6; and
  ``CommComputeOverlap`` wrapped around its dispatcher, bitwise the sequential pair;
- the pipeline engine's 1F1B with ``overlap_b_f`` (a Linear + MoE block per stage; expert parallel over
  the pipeline replicas on 4 ranks) with its FWD_BWD pairs run through CommComputeOverlap: bitwise the
  same pairs run one after the other, every pair through ``run`` and every hook paired
  (``expert_overlap_pipeline.py``);
- the same pair run on two plain threads without the coordinator, one rank's forward and another rank's
  backward delayed, exchanges mismatch and the result differs; with the coordinator it does not.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from hyper_adaptor.parallel.expert import (
    CommComputeOverlap,
    ExpertParallel,
    MoE,
    OverlapStats,
    _overlap,
    all_to_all,
    chunk_order,
    exchange_counts,
    experts_per_rank,
    measure_exposed_comm,
    moe_forward_overlapped,
    overlapped_moe_forward,
    permute,
    reorder,
    send_splits,
    unpermute,
)

HIDDEN, FFN, EXPERTS, TOPK = 8, 12, 8, 2
CHUNKS = (1, 2, 3, 4, 16)
PLACEMENTS = {2: [3, 5], 4: [3, 1, 2, 2]}


def tokens_of(rank: int) -> int:
    return 9 + 2 * rank  # uneven per rank; fewer than 16, so chunks=16 has empty chunks


# ----------------------------------------------------------------------------------- the model
def make_weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) / shape[-2] ** 0.5

    return dict(w1=rand(EXPERTS, HIDDEN, FFN), w3=rand(EXPERTS, HIDDEN, FFN), w2=rand(EXPERTS, FFN, HIDDEN),
                s1=rand(HIDDEN, FFN), s3=rand(HIDDEN, FFN), s2=rand(FFN, HIDDEN), router=rand(HIDDEN, EXPERTS))


def make_tokens(rank: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    n = tokens_of(rank)
    return torch.randn(n, HIDDEN, generator=g), torch.randn(n, HIDDEN, generator=g)  # tokens, output grad


def swiglu(x, w1, w3, w2):
    return (torch.nn.functional.silu(x @ w1) * (x @ w3)) @ w2


def experts_fn(w1, w3, w2):
    """Local experts on rows grouped by expert (GroupedExperts' signature), one GEMM chain per expert."""

    def run(x, per_expert):
        pieces, start = [], 0
        for e, count in enumerate(per_expert):
            pieces.append(swiglu(x[start:start + count], w1[e], w3[e], w2[e]))
            start += count
        return torch.cat(pieces) if pieces else x.new_zeros(0, HIDDEN)

    return run


def route(tokens, router):
    """Softmax top-k: (routing_map bool [T, E], probs [T, E], zero off the map)."""
    scores = torch.softmax(tokens @ router, dim=-1)
    top = scores.topk(TOPK, dim=-1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
    return routing_map, scores * routing_map


def local_range(placement, rank):
    start = sum(placement[:rank])
    return start, start + placement[rank]


def run_case(group, weights, tokens, dout, *, chunks=1, overlap=True, shared=False, placement=None, stats=None):
    """One forward + backward on this rank: output and every gradient (local expert slices)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    placement = placement or experts_per_rank(EXPERTS, size)
    lo, hi = local_range(placement, rank)
    leaves = {k: v.clone().requires_grad_() for k, v in weights.items() if k in ("s1", "s3", "s2", "router")}
    for k in ("w1", "w3", "w2"):
        leaves[k] = weights[k][lo:hi].clone().requires_grad_()
    x = tokens.clone().requires_grad_()
    routing_map, probs = route(x, leaves["router"])
    shared_fn = (lambda t: swiglu(t, leaves["s1"], leaves["s3"], leaves["s2"])) if shared else None
    out = overlapped_moe_forward(x, routing_map, probs, experts_fn(leaves["w1"], leaves["w3"], leaves["w2"]),
                                 ep_group=group, chunks=chunks, shared_fn=shared_fn, placement=placement,
                                 overlap=overlap, stats=stats)
    (out * dout).sum().backward()
    result = {"out": out.detach(), "tokens": x.grad}
    for k, leaf in leaves.items():
        if shared or k not in ("s1", "s3", "s2"):
            result[k] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    return result


def reference(weights, world_size, rank, *, shared, placement):
    """Single process, float64: every rank's tokens through every expert densely, no communication.
    Expert gradients sum over every rank's tokens; the router and the shared expert are replicated (not
    reduced here), so theirs come from this rank's tokens only."""
    experts = {k: weights[k].double().requires_grad_() for k in ("w1", "w3", "w2")}
    mine = None
    for r in range(world_size):
        w = dict(experts, **{k: weights[k].double().requires_grad_() for k in ("s1", "s3", "s2", "router")})
        tokens, dout = make_tokens(r)
        x = tokens.double().requires_grad_()
        routing_map, probs = route(x, w["router"])
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            out = out + probs[:, e:e + 1] * swiglu(x, w["w1"][e], w["w3"][e], w["w2"][e])
        if shared:
            out = out + swiglu(x, w["s1"], w["s3"], w["s2"])
        (out * dout.double()).sum().backward()
        if r == rank:
            mine = dict(out=out.detach(), tokens=x.grad, router=w["router"].grad, w=w)
    lo, hi = local_range(placement, rank)
    result = {"out": mine["out"], "tokens": mine["tokens"], "router": mine["router"]}
    for k in ("w1", "w3", "w2"):
        result[k] = experts[k].grad[lo:hi]
    if shared:
        result.update({k: mine["w"][k].grad for k in ("s1", "s3", "s2")})
    return result


def compare(got: dict, want: dict, tol: float | None) -> tuple[list[str], float]:
    """Failures (``tol=None``: bitwise) and the largest difference, relative to max(1, |want|)."""
    failures, worst = [], 0.0
    if set(got) != set(want):
        return [f"keys {sorted(got)} != {sorted(want)}"], float("inf")
    for k in want:
        a, b = got[k].double(), want[k].double()
        if a.shape != b.shape:
            failures.append(f"{k}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            continue
        diff = (a - b).abs().max().item() / max(1.0, b.abs().max().item()) if a.numel() else 0.0
        worst = max(worst, diff)
        if tol is None and not torch.equal(got[k], want[k]):
            failures.append(f"{k}: not bitwise equal (largest difference {diff:.3g})")
        elif tol is not None and diff > tol:
            failures.append(f"{k}: off by {diff:.3g} > {tol}")
    return failures, worst


# ------------------------------------------------------------------------- a two-function MoE layer
def dispatch(tokens, routing_map, probs, group, placement):
    """The engine's dispatch as a function (for wrap_dispatch): rows grouped by local expert + state."""
    rows, perm = permute(tokens, routing_map, probs)
    received = exchange_counts(perm.tokens_per_expert, placement, group)
    sent, got = send_splits(perm.tokens_per_expert, placement), received.sum(dim=1).tolist()
    index, per_expert = chunk_order(received)
    arrived = all_to_all(rows, got, sent, group)
    return reorder(arrived, index), SimpleNamespace(perm=perm, sent=sent, got=got, index=index, per_expert=per_expert)


def combine(expert_out, state, group):
    back = reorder(expert_out, _overlap.inverse(state.index))
    return unpermute(all_to_all(back, state.sent, state.got, group), state.perm)


class ToyMoE:
    """``layers`` blocks of: pre-compute (an attention stand-in), router, dispatch, experts, combine."""

    def __init__(self, weights, group, layers, overlap: CommComputeOverlap | None):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.placement = experts_per_rank(EXPERTS, size)
        lo, hi = local_range(self.placement, rank)
        self.params = []
        for i in range(layers):
            p = {k: weights[k].clone().mul(1 + 0.1 * i).requires_grad_() for k in ("s1", "router")}
            p.update({k: weights[k][lo:hi].clone().requires_grad_() for k in ("w1", "w3", "w2")})
            self.params.append(p)
        self.group = group
        d = lambda t, m, p: dispatch(t, m, p, group, self.placement)  # noqa: E731
        c = lambda y, s: combine(y, s, group)  # noqa: E731
        self.dispatch = [overlap.wrap_dispatch(d) if overlap else d for _ in range(layers)]
        self.combine = [overlap.wrap_combine(c, is_last_layer=i == layers - 1) if overlap else c
                        for i in range(layers)]

    def loss(self, x):
        for i, p in enumerate(self.params):
            h = torch.tanh(x @ p["s1"][:, :HIDDEN])
            routing_map, probs = route(h, p["router"])
            rows, state = self.dispatch[i](h, routing_map, probs)
            y = experts_fn(p["w1"], p["w3"], p["w2"])(rows, state.per_expert)
            x = h + self.combine[i](y, state)
        return x.pow(2).mean()

    def grads(self):
        return {f"{i}.{k}": v.grad.clone() for i, p in enumerate(self.params) for k, v in p.items()}


def microbatch(rank, m):
    g = torch.Generator().manual_seed(500 + 10 * rank + m)
    return torch.randn(tokens_of(rank), HIDDEN, generator=g)


def run_pair(weights, group, layers, *, overlapped: bool):
    """Losses and gradients of micro-batches 0 and 1: forward 0, then (backward 0, forward 1) either one
    after the other or through CommComputeOverlap.run, then backward 1."""
    rank = dist.get_rank(group)
    overlap = CommComputeOverlap(timeout=60) if overlapped else None
    model = ToyMoE(weights, group, layers, overlap)
    loss0 = model.loss(microbatch(rank, 0))
    if overlapped:
        loss1 = overlap.run(lambda: model.loss(microbatch(rank, 1)), loss0.backward)
        pairs = overlap.coordinator.pairs
        overlap.close()
    else:
        loss0.backward()
        loss1 = model.loss(microbatch(rank, 1))
        pairs = 0
    loss1.backward()
    return dict(model.grads(), loss0=loss0.detach(), loss1=loss1.detach()), pairs


# ------------------------------------------------------------------- ordering: the race shown
def race_pair(group, *, coordinated: bool):
    """Micro-batch 1's forward with micro-batch 0's backward, each one exchange there and one back of
    equal sizes. Even ranks delay their forward, odd ranks their backward: without the coordinator even
    ranks issue the backward's exchanges first and odd ranks the forward's, which the collective silently
    pairs up (the delay also keeps the two threads of a rank from ever issuing at the same moment)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(HIDDEN, HIDDEN, generator=g).requires_grad_()
    splits = [3] * size
    overlap = CommComputeOverlap(timeout=60)
    there = overlap.wrap_dispatch(lambda t: all_to_all(t, splits, splits, group))
    back = overlap.wrap_combine(lambda t: all_to_all(t, splits, splits, group), is_last_layer=True)

    def loss(m):
        x = torch.randn(3 * size, HIDDEN, generator=torch.Generator().manual_seed(10 * rank + m))
        return back(torch.tanh(there(x @ w) @ w)).pow(2).sum()

    loss0 = loss(0)

    def fwd():
        if rank % 2 == 0:
            time.sleep(0.5)
        return loss(1)

    def bwd():
        if rank % 2 == 1:
            time.sleep(0.5)
        loss0.backward()

    if coordinated:
        loss1 = overlap.run(fwd, bwd)
    else:
        box = {}
        thread = threading.Thread(target=bwd)
        thread.start()
        box["loss1"] = fwd()
        thread.join()
        loss1 = box["loss1"]
    overlap.close()
    loss1.backward()
    return {"loss0": loss0.detach(), "loss1": loss1.detach(), "w": w.grad.clone()}


def race_reference(group):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(HIDDEN, HIDDEN, generator=g).requires_grad_()
    splits = [3] * size
    losses = []
    for m in range(2):
        x = torch.randn(3 * size, HIDDEN, generator=torch.Generator().manual_seed(10 * rank + m))
        y = all_to_all(torch.tanh(all_to_all(x @ w, splits, splits, group) @ w), splits, splits, group)
        loss = y.pow(2).sum()
        loss.backward()
        losses.append(loss.detach())
    return {"loss0": losses[0], "loss1": losses[1], "w": w.grad.clone()}


# ------------------------------------------------------------------------ a wait left out
def broken_wait_case(group, weights, tokens, dout):
    """The overlapped forward with its waits deferred to the end and rank 1 late to send: ranks that read
    rank 1's rows before they arrived get a different output (the check must be able to fail)."""
    rank = dist.get_rank(group)
    deferred = []
    real_await, real_exchange = _overlap._await, _overlap._exchange

    def no_wait(handle, stats, backward):
        if backward:
            real_await(handle, stats, backward)
        else:
            deferred.append(handle)

    def late_exchange(x, out_splits, in_splits, grp, async_op):
        if rank == 1:
            time.sleep(0.3)
        return real_exchange(x, out_splits, in_splits, grp, async_op)

    _overlap._await, _overlap._exchange = no_wait, late_exchange
    try:
        with torch.no_grad():
            routing_map, probs = route(tokens, weights["router"])
            lo, hi = local_range(experts_per_rank(EXPERTS, dist.get_world_size(group)), rank)
            out = overlapped_moe_forward(tokens, routing_map, probs,
                                         experts_fn(weights["w1"][lo:hi], weights["w3"][lo:hi], weights["w2"][lo:hi]),
                                         ep_group=group, chunks=2).clone()
    finally:
        _overlap._await, _overlap._exchange = real_await, real_exchange
        for handle in deferred:
            real_await(handle, None, False)
    return out


# ------------------------------------------------------------------- exchanges really in flight
def in_flight_case(group, weights, tokens, dout, *, chunks, overlap):
    """The most exchanges started and not yet waited for at once, in the forward and in the backward."""
    real_await, real_exchange = _overlap._await, _overlap._exchange
    count, peak, phase = [0], {"forward": 0, "backward": 0}, ["forward"]

    def counting_exchange(x, out_splits, in_splits, grp, async_op):
        out, handle = real_exchange(x, out_splits, in_splits, grp, async_op)
        if handle is not None:
            count[0] += 1
            peak[phase[0]] = max(peak[phase[0]], count[0])
        return out, handle

    def counting_await(handle, stats, backward):
        if backward:
            phase[0] = "backward"
        if handle is not None:
            count[0] -= 1
        real_await(handle, stats, backward)

    _overlap._await, _overlap._exchange = counting_await, counting_exchange
    try:
        run_case(group, weights, tokens, dout, chunks=chunks, overlap=overlap, shared=True)
    finally:
        _overlap._await, _overlap._exchange = real_await, real_exchange
    return peak


# ------------------------------------------------------------------------- the engine's MoE block
def engine_moe(mesh, **options):
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(7)
    moe = MoE(HIDDEN, FFN, EXPERTS, TOPK, shared_ffn=FFN, aux_loss_coeff=0.01, **options)
    return parallelize_module(moe, mesh, ExpertParallel())


def engine_step(moe, x, dout, chunks):
    """Output, aux loss and every gradient of one step of the block: its own forward (chunks None) or
    ``moe_forward_overlapped``."""
    x = x.clone().requires_grad_()
    if chunks is None:
        out, aux = moe(x, return_aux_loss=True)
    else:
        out, aux = moe_forward_overlapped(moe, x, chunks=chunks, return_aux_loss=True)
    ((out * dout).sum() + aux).backward()
    return dict({n: p.grad.clone() for n, p in moe.named_parameters()}, out=out.detach(), aux=aux.detach(),
                x=x.grad)


def engine_pair(mesh, rank, *, overlapped):
    """CommComputeOverlap around the block's own dispatcher: forward 0; (backward 0, forward 1); backward 1."""
    moe = engine_moe(mesh)
    overlap = CommComputeOverlap(timeout=60) if overlapped else None
    if overlapped:
        moe.dispatcher.dispatch = overlap.wrap_dispatch(moe.dispatcher.dispatch)
        moe.dispatcher.combine = overlap.wrap_combine(moe.dispatcher.combine, is_last_layer=True)

    def loss(m):
        x = microbatch(rank, m).requires_grad_()
        return moe(torch.tanh(x)).pow(2).mean()

    loss0, pairs = loss(0), 0
    if overlapped:
        loss1 = overlap.run(lambda: loss(1), loss0.backward)
        pairs = overlap.coordinator.pairs
        overlap.close()
    else:
        loss0.backward()
        loss1 = loss(1)
    loss1.backward()
    return dict({n: p.grad.clone() for n, p in moe.named_parameters()}, loss0=loss0.detach(),
                loss1=loss1.detach()), pairs


def engine_checks(world_size, rank, checks, worst):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    x, dout = make_tokens(rank, seed=3)
    for name, options in (("dropless", {}), ("capacity", dict(capacity_factor=1.0))):
        own = engine_step(engine_moe(mesh, **options), x, dout, None)
        for chunks in (1, 2, 4):
            got = engine_step(engine_moe(mesh, **options), x, dout, chunks)
            key = f"engine-moe/{name}/chunks{chunks}"
            checks[key], worst[key] = compare(got, own, None if chunks == 1 else 1e-6)
    for options in (dict(capacity_factor=1.0, pad_to_capacity=True),):
        try:
            moe_forward_overlapped(engine_moe(mesh, **options), x)
            checks["engine-moe/padding-refused"] = ["pad_to_capacity was chunked"]
        except ValueError as exc:
            checks["engine-moe/padding-refused"] = [] if "pad_to_capacity" in str(exc) else [str(exc)]
    want, _ = engine_pair(mesh, rank, overlapped=False)
    got, pairs = engine_pair(mesh, rank, overlapped=True)
    checks["engine-moe/comm-compute-overlap"], _ = compare(got, want, None)
    if pairs != 3:
        checks["engine-moe/comm-compute-overlap"].append(f"{pairs} hooks paired, want 3")


# --------------------------------------------------------------------------------------- all
def overlap_checks(rank: int, world_size: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    group = dist.group.WORLD
    weights = make_weights()
    tokens, dout = make_tokens(rank)
    checks, worst = {}, {}

    def record(name, failures_and_diff):
        checks[name], worst[name] = failures_and_diff

    for shared in (False, True):
        tag = "shared" if shared else "routed"
        even = experts_per_rank(EXPERTS, world_size)
        plain = run_case(group, weights, tokens, dout, overlap=False, shared=shared)
        record(f"plain-vs-single-process/{tag}",
               compare(plain, reference(weights, world_size, rank, shared=shared, placement=even), 1e-5))
        for chunks in CHUNKS:
            stats = OverlapStats()
            got = run_case(group, weights, tokens, dout, chunks=chunks, shared=shared, stats=stats)
            same_chunks = plain if chunks == 1 else run_case(group, weights, tokens, dout, chunks=chunks,
                                                              overlap=False, shared=shared)
            record(f"overlap-vs-plain/chunks{chunks}/{tag}", compare(got, same_chunks, None))
            if chunks > 1:
                record(f"chunks-vs-one/chunks{chunks}/{tag}", compare(got, plain, 1e-6))
            checks[f"launches/chunks{chunks}/{tag}"] = (
                [] if stats.launches == 4 * chunks else [f"{stats.launches} exchanges, want {4 * chunks}"])

    for chunks, overlap, want in ((4, True, 2), (4, False, 1), (1, False, 1)):
        peak = in_flight_case(group, weights, tokens, dout, chunks=chunks, overlap=overlap)
        name = f"in-flight/chunks{chunks}/{'overlap' if overlap else 'plain'}"
        checks[name] = [f"{phase}: at most {n} exchanges in flight, want {'>= ' if overlap else ''}{want}"
                        for phase, n in peak.items() if (n < want if overlap else n != want)]

    placement = PLACEMENTS[world_size]
    got = run_case(group, weights, tokens, dout, chunks=2, shared=True, placement=placement)
    record("placement/overlap-vs-single-process",
           compare(got, reference(weights, world_size, rank, shared=True, placement=placement), 1e-5))

    try:
        overlapped_moe_forward(tokens, *route(tokens, weights["router"]), experts_fn(None, None, None),
                               ep_group=group, placement=[EXPERTS] + [1] * (world_size - 1))
        checks["placement/refused"] = ["a placement over more experts than the router has ran"]
    except ValueError as exc:
        checks["placement/refused"] = [] if "placement" in str(exc) else [f"unclear error: {exc}"]

    plain_no_grad = run_case(group, weights, tokens, dout, chunks=2, overlap=False)["out"]
    broken = broken_wait_case(group, weights, tokens, dout)
    broken_detected = not torch.allclose(broken, plain_no_grad, atol=1e-5)

    for layers in (1, 2):
        want, _ = run_pair(weights, group, layers, overlapped=False)
        got, pairs = run_pair(weights, group, layers, overlapped=True)
        record(f"comm-compute-overlap/{layers}-layers", compare(got, want, None))
        if pairs != 4 * layers - 1:
            checks[f"comm-compute-overlap/{layers}-layers"].append(f"{pairs} hooks paired, want {4 * layers - 1}")

    engine_checks(world_size, rank, checks, worst)
    from tests.distributed.expert_overlap_pipeline import pipeline_checks

    pipeline_checks(world_size, rank, checks)

    want = race_reference(group)
    record("race/coordinated", compare(race_pair(group, coordinated=True), want, None))
    race_failures, _ = compare(race_pair(group, coordinated=False), want, None)

    rows = measure_exposed_comm(tokens, *route(tokens, weights["router"]),
                                experts_fn(*(weights[k][local_range(even, rank)[0]:local_range(even, rank)[1]]
                                             for k in ("w1", "w3", "w2"))),
                                ep_group=group, chunks=(2,), steps=1, backward=False)
    measure_ok = [r["mode"] for r in rows] == ["plain", "overlap"] and all(
        r["step_s"] > 0 and 0 <= r["exposed_comm_s"] <= r["step_s"] for r in rows)
    dist.barrier()
    return dict(checks=checks, worst=worst, broken_detected=broken_detected, race_detected=bool(race_failures),
                measure_ok=measure_ok)

