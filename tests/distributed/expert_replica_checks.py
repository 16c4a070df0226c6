"""Hot-expert replica checks, run inside a gloo world (hyper_adaptor/testing/world.py).

A MoE layer (8 experts, top-2, GeLU FFN) on an EP group of 4 with a Zipf-skewed router (a fixed
logit bias piling the tokens on rank 0's experts) trains a few steps, each rank on its own tokens:
without replicas, with ``HotExpertReplicas`` (replanned every two steps from the counts it observed,
so the first plan replaces no plan and the second may move replicas), and with the replicas wired
wrongly (the replicas' gradients never reach the owners; the replicas' weights not refreshed after the
optimizer step). The dispatch is the engine's: permute over slots, the count exchange with the plan's
uneven placement, the uneven all-to-all and its reverse (``dispatcher`` picks the primitives or the
``AllToAllDispatcher``). Each run returns its losses, its final owned weights and router, and the rows
each rank computed per step; the tolerances live in tests/distributed/test_expert_replicas.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyper_adaptor.parallel.expert import (
    all_to_all,
    chunk_order,
    exchange_counts,
    permute,
    reorder,
    send_splits,
    unpermute,
)
from hyper_adaptor.parallel.expert._comm import inverse
from hyper_adaptor.parallel.expert._replicas import HotExpertReplicas, attach_replicas, zipf_bias

EXPERTS, TOPK, HIDDEN, FFN, TOKENS = 8, 2, 8, 16, 96
STEPS, INTERVAL, REPLICAS, ZIPF = 7, 2, 3, 1.5
MODES = ("off", "on", "no-grad-reduce", "stale-weights")


def _primitive_dispatch(tokens, slot_map, slot_probs, placement, group):
    """(expert_in, rows per local slot, combine): the uneven exchange from the primitives."""
    rows, perm = permute(tokens, slot_map, slot_probs)
    received = exchange_counts(perm.tokens_per_expert, placement, group)
    in_splits = send_splits(perm.tokens_per_expert, placement)
    out_splits = [int(c) for c in received.sum(1).tolist()]
    index, per_local = chunk_order(received)
    expert_in = reorder(all_to_all(rows, out_splits, in_splits, group), index)

    def combine(expert_out):
        back = all_to_all(reorder(expert_out, inverse(index)), in_splits, out_splits, group)
        return unpermute(back, perm)

    return expert_in, per_local, combine


def _engine_dispatch(tokens, slot_map, slot_probs, placement, group):
    from hyper_adaptor.parallel.expert import AllToAllDispatcher

    dispatcher = AllToAllDispatcher(slot_map.shape[1], group, placement=list(placement))
    expert_in, per_local = dispatcher.dispatch(tokens, slot_map, slot_probs)
    return expert_in, list(per_local), dispatcher.combine


def _experts(x, per_local, w1, w2):
    pieces, start = [], 0
    for i, count in enumerate(per_local):
        pieces.append(F.gelu(x[start:start + count] @ w1[i]) @ w2[i])
        start += count
    return torch.cat(pieces) if pieces else x.new_zeros(0, x.shape[1])


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, HIDDEN, generator=g)


def train(rank, world, mode, optimizer, dispatcher="primitives", layout=None):
    """``layout``: None for one EP group of the whole world; else (ep_group, expert_dp_group, experts,
    replicas) — experts replicated over the expert-data-parallel group, their gradients summed over
    it after the replica reduction, which then goes through ``main_grad`` as megatron's DDP keeps it."""
    group, edp_group, experts, replicas = layout or (dist.group.WORLD, None, EXPERTS, REPLICAS)
    ep_size, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = experts // ep_size
    g = torch.Generator().manual_seed(0)   # every rank draws every expert, keeps its own
    w1_all = torch.randn(experts, HIDDEN, FFN, generator=g) / HIDDEN ** 0.5
    w2_all = torch.randn(experts, FFN, HIDDEN, generator=g) / FFN ** 0.5
    router = torch.nn.Parameter(torch.randn(experts, HIDDEN, generator=g) * 0.1)
    mine = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    w1 = torch.nn.Parameter(w1_all[mine].clone())
    w2 = torch.nn.Parameter(w2_all[mine].clone())
    params = [w1, w2, router]
    opt = (torch.optim.SGD(params, lr=0.1, momentum=0.9) if optimizer == "sgd"
           else torch.optim.Adam(params, lr=1e-2))
    bias = zipf_bias(experts, ZIPF)
    mgr = HotExpertReplicas(experts, group, replicas=replicas if mode != "off" else 0, interval=INTERVAL)
    dispatch = _primitive_dispatch if dispatcher == "primitives" else _engine_dispatch
    losses, rows, plans = [], [], []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        probs = torch.softmax(x @ router.t() + bias, dim=-1)
        top = probs.topk(TOPK, dim=-1).indices
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, top, True)
        mgr.observe(routing_map.sum(0))
        slot_map, slot_probs = mgr.route(routing_map, probs * routing_map)
        expert_in, per_local, combine = dispatch(x, slot_map, slot_probs, mgr.placement, group)
        w1_local, w2_local = mgr.local_weights([w1, w2])
        out = combine(_experts(expert_in, per_local, w1_local, w2_local))
        loss = F.mse_loss(out, y) / world          # the mean over ranks of each rank's loss
        opt.zero_grad()
        loss.backward()
        dist.all_reduce(router.grad)               # the router is replicated: data-parallel sum
        grad_attr = "grad" if edp_group is None else "main_grad"
        if edp_group is not None:
            for p in (w1, w2):
                p.main_grad = p.grad.clone()
        if mode != "no-grad-reduce":
            mgr.reduce_grads([w1, w2], grad_attr=grad_attr)
        if edp_group is not None:
            for p in (w1, w2):
                dist.all_reduce(p.main_grad, group=edp_group)
                p.grad = p.main_grad
        opt.step()
        changed = mgr.step()
        if mode != "stale-weights" or changed:
            mgr.sync_weights([w1, w2])
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        rows.append(sum(per_local))
        plans.append((mgr.plan.placement, mgr.plan.slot_expert, mgr.plan.weights))
    return {"losses": losses, "w1": w1.detach().clone(), "w2": w2.detach().clone(),
            "router": router.detach().clone(), "rows": rows, "plans": plans, "report": mgr.load_report()}


def train_block(rank, world, replicas):
    """The engine's ``MoE`` block (SwiGLU, a shared expert) sharded by ``ExpertParallel`` on a 1-D
    "ep" mesh, with ``attach_replicas`` when ``replicas``; the router skewed through a constant input
    feature whose router weights are the Zipf bias. Adam on every parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from hyper_adaptor.parallel.expert import ExpertParallel, MoE

    torch.manual_seed(0)
    moe = MoE(HIDDEN, FFN, EXPERTS, TOPK, shared_ffn=FFN)
    with torch.no_grad():
        moe.router.weight.mul_(0.1)[:, 0] = zipf_bias(EXPERTS, ZIPF) / 3
    parallelize_module(moe, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)), ExpertParallel())
    mgr = attach_replicas(moe, replicas=REPLICAS, interval=INTERVAL) if replicas else None
    opt = torch.optim.Adam(moe.parameters(), lr=1e-2)
    experts = list(moe.experts.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        x[:, 0] = 3.0
        loss = F.mse_loss(moe(x), y) / world
        opt.zero_grad()
        loss.backward()
        for p in moe.parameters():
            if all(p is not q for q in experts):
                dist.all_reduce(p.grad)            # router and shared expert: data-parallel sum
        if mgr:
            mgr.reduce_grads()
        opt.step()
        if mgr:
            mgr.step()
            mgr.sync_weights()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return {"losses": losses, "params": [p.detach().clone() for p in moe.parameters()],
            "report": mgr.load_report() if mgr else None}


def _diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _compare(runs, ref, key):
    return {key: {"loss": max(abs(a - b) for a, b in zip(runs["losses"], ref["losses"])),
                  "weights": _diff([runs["w1"], runs["w2"], runs["router"]], [ref["w1"], ref["w2"], ref["router"]]),
                  "rows": runs["rows"], "plans": runs["plans"], "report": runs["report"], "losses": runs["losses"]}}


def replica_checks(rank, world_size, dispatchers=("primitives",)):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    result = {}
    for dispatcher in dispatchers:
        for optimizer in ("sgd", "adam"):
            # the wrong wirings need only one dispatcher to show
            modes = MODES if dispatcher == "primitives" else MODES[:2]
            runs = {mode: train(rank, world_size, mode, optimizer, dispatcher) for mode in modes}
            for mode, run in runs.items():
                result.update(_compare(run, runs["off"], f"{dispatcher}-{optimizer}-{mode}"))
    # two EP groups of 2 ({0, 1}, {2, 3}), the experts data-parallel over {0, 2} and {1, 3}: group
    # ranks are not world ranks, and the owner's gradient is megatron's main_grad
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    edp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    layout = (ep_groups[rank // 2], edp_groups[rank % 2], 4, 2)
    runs = {mode: train(rank, world_size, mode, "adam", layout=layout) for mode in ("off", "on", "no-grad-reduce")}
    for mode, run in runs.items():
        result.update(_compare(run, runs["off"], f"ep2x2-adam-{mode}"))
    # the library block: MoE + ExpertParallel + attach_replicas
    off, on = train_block(rank, world_size, False), train_block(rank, world_size, True)
    result["block"] = {"loss": max(abs(a - b) for a, b in zip(on["losses"], off["losses"])),
                       "weights": _diff(on["params"], off["params"]), "report": on["report"]}
    return result
