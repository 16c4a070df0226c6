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


def build(variant: str, seed: int = SEED, **groups):
    from hyper_adaptor.parallel.expert import MoE

    torch.manual_seed(seed)
    opts = dict(shared_ffn=SHARED, aux_loss_coeff=0.01, activation="swiglu")
    opts.update(VARIANTS[variant])
    return MoE(HIDDEN, FFN, EXPERTS, TOPK, **opts, **groups)


def built_sharded(mesh, layout: dict):
    """The block built with its process groups (only the local experts allocated), then loaded with
    the matching slices of the full block's weights."""
    variant = layout.get("variant", "base")
    ep_group = mesh["ep"].get_group() if mesh.ndim == 2 else mesh.get_group()
    etp_group = mesh["tp"].get_group() if layout.get("etp") else None
    model = build(variant, ep_group=ep_group, etp_group=etp_group, placement=layout.get("placement"))
    full = dict(build(variant).named_parameters())
    experts = model.experts
    shard = dist.get_rank(etp_group) if etp_group is not None else 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = full[name]
            if name.startswith("experts."):
                dim = 2 if name.endswith("w_down") else 1
                source = source[experts.first_expert:experts.first_expert + experts.num_experts]
                source = source.narrow(dim, shard * experts.ffn, experts.ffn)
            param.copy_(source)
    return model


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
    if layout.get("built_sharded"):
        model = built_sharded(mesh, layout)
    else:
        # "rank_init": every rank initialises differently; the style's broadcast from the mesh's first
        # rank (src_data_rank=0, parallelize_module's default) must still give the reference's weights
        model = build(layout.get("variant", "base"), seed=SEED + rank if layout.get("rank_init") else SEED)
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


def against_megatron(rank: int, world: int, ep: int) -> dict:
    """megatron's ``MoELayer`` with its all-to-all dispatcher (local spec, GeLU experts, softmax top-k
    router without a balancing loss; tests/distributed/moe_dispatcher_checks.py builds it) and the
    engine's block with the same weights, on the same tokens at the same EP layout: each rank's
    (engine, megatron) output, input gradient, router gradient and local expert weight gradients."""
    from torch.distributed.tensor.parallel import parallelize_module

    from hyper_adaptor.parallel.expert import ExpertParallel, MoE
    from tests.distributed import moe_dispatcher_checks as megatron_side

    from megatron.core import parallel_state as ps

    layer = megatron_side._build(ep, 1, 1, "alltoall", False, dict(moe_router_load_balancing_type="none"))
    x, probe = megatron_side.chunk(rank)
    x_megatron = x.clone().requires_grad_()
    out_megatron, _ = layer(x_megatron)
    (out_megatron * probe).sum().backward()
    local = layer.experts.local_experts
    megatron_grads = {"w_up": torch.stack([e.linear_fc1.weight.grad for e in local]),
                      "w_down": torch.stack([e.linear_fc2.weight.grad for e in local])}
    router_megatron = layer.router.weight.grad.clone()
    ps.destroy_model_parallel()

    full = megatron_side.full_weights()
    # megatron's default router: softmax over the top-k logits, i.e. the top-k softmax scores renormalised
    moe = MoE(megatron_side.HIDDEN, megatron_side.FFN, megatron_side.EXPERTS, megatron_side.TOPK,
              activation="gelu", normalize_topk=True)
    with torch.no_grad():
        moe.router.weight.copy_(full["router"])
        moe.experts.w_up.copy_(full["fc1"])
        moe.experts.w_down.copy_(full["fc2"])
    parallelize_module(moe, _mesh(dict(ep=ep)), ExpertParallel())
    x_engine = x.clone().requires_grad_()
    out_engine = moe(x_engine)
    (out_engine * probe).sum().backward()
    return {"output": (out_engine.detach(), out_megatron.detach()),
            "input gradient": (x_engine.grad, x_megatron.grad),
            "router gradient": (moe.router.weight.grad, router_megatron),
            **{f"{n} gradient": (moe.experts.projections()[n].grad, g) for n, g in megatron_grads.items()}}


def layouts(rank: int, world: int, runs: dict) -> dict:
    dist.init_process_group("gloo")
    results = {}
    for name, layout in runs.items():
        try:
            if layout.get("megatron"):
                results[name] = against_megatron(rank, world, layout["ep"])
            else:
                results[name] = one_layout(rank, world, layout)
        except Exception:
            # a layout that fails on every rank fails alone; one that fails on some ranks only would
            # leave the others waiting in a collective, which the world's timeout turns into a failure
            results[name] = traceback.format_exc()
    return results
