"""Rank code for tests/distributed/test_expert_engine.py: the plain ``MoE`` block sharded by
``ExpertParallel`` / ``ExpertTensorParallel`` on gloo, and the single-process reference it is held to.

Every rank builds the same block (one seed), is handed its own tokens (chunk ``rank`` of one
[world, T, H] batch) and a loss ``sum(out * w) + aux``; the reference runs the unsharded block once
per chunk (capacity is per call, as it is per rank) and sums the losses before one backward.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

HIDDEN, FFN, EXPERTS, TOPK, SHARED = 16, 32, 8, 2, 24
SHAPE = (3, 4)          # each rank's tokens: [3, 4, HIDDEN] -> 12 tokens
SEED = 1234

# block options a layout may name as its "variant"
VARIANTS = {
    "base": {},
    # capacity 1.0: ceil(12 * 2 / 8) = 3 rows per expert per rank; most experts overflow or fall short
    "capacity-pad": dict(capacity_factor=1.0, pad_to_capacity=True),
    "capacity-position": dict(capacity_factor=1.0, drop_policy="position"),
    "sigmoid-gelu": dict(score_function="sigmoid", activation="gelu"),
}


def build(variant: str):
    from hyper_adaptor.parallel.expert import MoE

    torch.manual_seed(SEED)
    opts = dict(shared_ffn=SHARED, aux_loss_coeff=0.01, activation="swiglu")
    opts.update(VARIANTS[variant])
    return MoE(HIDDEN, FFN, EXPERTS, TOPK, **opts)


def batch(world: int):
    """[world, *SHAPE, H] tokens and loss weights. Scaled so that the router is not near ties."""
    gen = torch.Generator().manual_seed(SEED + world)
    tokens = torch.randn(world, *SHAPE, HIDDEN, generator=gen) * 2
    weights = torch.randn(world, *SHAPE, HIDDEN, generator=gen)
    return tokens, weights


def _grads(model) -> dict:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def reference(world: int, variant: str) -> dict:
    """The unsharded block over the world's chunks: per-chunk outputs, input grads and aux losses,
    and every parameter's gradient of the summed loss."""
    model = build(variant)
    tokens, weights = batch(world)
    tokens = tokens.clone().requires_grad_()
    outs, auxes, loss = [], [], 0
    for r in range(world):
        out, aux = model(tokens[r], return_aux_loss=True)
        outs.append(out.detach())
        auxes.append(aux.detach())
        loss = loss + (out * weights[r]).sum() + aux
    loss.backward()
    return {"out": outs, "x_grad": tokens.grad.detach(), "aux": auxes, "grads": _grads(model)}


def _mesh(layout: dict):
    from torch.distributed.device_mesh import init_device_mesh

    if layout.get("tp", 1) == 1:
        return init_device_mesh("cpu", (layout["ep"],), mesh_dim_names=("ep",))
    return init_device_mesh("cpu", (layout["ep"], layout["tp"]), mesh_dim_names=("ep", "tp"))


def one_layout(rank: int, world: int, layout: dict) -> dict:
    from torch.distributed.tensor.parallel import parallelize_module

    from hyper_adaptor.parallel.expert import ExpertParallel, ExpertTensorParallel

    mesh = _mesh(layout)
    model = build(layout.get("variant", "base"))
    style_cls = ExpertTensorParallel if layout.get("etp") else ExpertParallel
    parallelize_module(model, mesh, style_cls(placement=layout.get("placement")))
    tokens, weights = batch(world)
    x = tokens[rank].clone().requires_grad_()
    out, aux = model(x, return_aux_loss=True)
    ((out * weights[rank]).sum() + aux).backward()
    grads = _grads(model)
    # dense parameters: each rank's gradient covers its own tokens; the user's reduction over the mesh
    for name, grad in grads.items():
        if not name.startswith("experts."):
            dist.all_reduce(grad)
    if layout.get("tp", 1) > 1 and not layout.get("etp"):
        # experts replicated over "tp" under ExpertParallel: their gradients sum over it
        for name, grad in grads.items():
            if name.startswith("experts."):
                dist.all_reduce(grad, group=mesh["tp"].get_group())
    experts, dispatcher = model.experts, model.dispatcher
    etp = dispatcher.etp_group
    return {"out": out.detach(), "x_grad": x.grad.detach(), "aux": aux.detach(), "grads": grads,
            "first": experts.first_expert, "count": experts.num_experts, "width": experts.ffn,
            "shard": dist.get_rank(etp) if etp is not None else 0,
            "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}}


def layouts(rank: int, world: int, runs: dict) -> dict:
    dist.init_process_group("gloo")
    results = {}
    for name, layout in runs.items():
        try:
            results[name] = one_layout(rank, world, layout)
        except Exception:
            # a layout that fails on every rank fails alone; one that fails on some ranks only would
            # leave the others waiting in a collective, which the world's timeout turns into a failure
            results[name] = traceback.format_exc()
    return results
