"""megatron-core's ``MoELayer`` (local spec) for bench/expert_parallel.py: one layer under a layout, with
megatron's own token dispatcher or the engine's, fixed weights and inputs, one forward + backward a step."""

from __future__ import annotations

import torch
import torch.distributed as dist

SEED = 2024


def dims(quick: bool) -> dict:
    """The layer: 8 experts, top-2, SwiGLU experts without bias; tokens per rank = seq x micro."""
    if quick:
        return {"hidden": 64, "ffn": 128, "experts": 8, "topk": 2, "seq": 64, "micro": 2}
    return {"hidden": 256, "ffn": 512, "experts": 8, "topk": 2, "seq": 512, "micro": 2}


def build(d: dict, ep: int, dispatcher: str, engine_chunks: int = 1, shared: bool = False):
    """The layer on this rank; ``dispatcher``: "allgather" / "alltoall" (megatron's) or "engine"
    (``--moe-dispatcher-engine hyper``'s dispatcher in megatron's layer)."""
    import torch.nn.functional as F

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=1, hidden_size=d["hidden"], num_attention_heads=4, ffn_hidden_size=d["ffn"],
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, num_moe_experts=d["experts"],
        moe_router_topk=d["topk"], moe_ffn_hidden_size=d["ffn"],
        moe_shared_expert_intermediate_size=d["ffn"] if shared else None,
        moe_token_dispatcher_type="allgather" if dispatcher == "allgather" else "alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, expert_model_parallel_size=ep,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    layer = get_gpt_layer_local_spec(num_experts=d["experts"]).submodules.mlp(config=config, layer_number=1)
    if dispatcher == "engine":
        from hyper_adaptor.patches.expert.dispatcher import dispatcher_class

        from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

        layer.token_dispatcher = dispatcher_class(engine_chunks)(
            layer.num_local_experts, layer.local_expert_indices, config=config,
            pg_collection=get_default_pg_collection())
        if layer.shared_expert_overlap:
            layer.token_dispatcher.set_shared_experts(layer.shared_experts)
    _load_weights(layer, d, ep)
    return layer


def full_weights(d: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every contender's full weights: router [E, H], fc1 [E, 2F, H] (gate rows first), fc2 [E, H, F]."""
    gen = torch.Generator().manual_seed(SEED)
    h, f, e = d["hidden"], d["ffn"], d["experts"]
    router = torch.randn(e, h, generator=gen) * 0.2
    fc1 = torch.randn(e, 2 * f, h, generator=gen) * h ** -0.5
    fc2 = torch.randn(e, h, f, generator=gen) * f ** -0.5
    return router, fc1, fc2


def install_engine():
    """What --moe-dispatcher-engine hyper installs; layers built afterwards get the engine's dispatcher
    (those built before keep megatron's). Returns the patch manager (``.undo()`` takes it back)."""
    import types

    from hyper_adaptor.patch_manager import PatchManager
    from hyper_adaptor.patches.expert import dispatcher

    manager = PatchManager()
    manager.register_all(dispatcher.patches(types.SimpleNamespace(moe_dispatch_chunks=1)))
    manager.apply()
    return manager


def _load_weights(layer, d: dict, ep: int) -> None:
    """Every contender gets the same full weights (each rank its experts)."""
    from megatron.core import parallel_state as ps

    router, fc1, fc2 = full_weights(d)
    local, rank = d["experts"] // ep, ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        layer.router.weight.copy_(router)
        for i, expert in enumerate(layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(fc1[rank * local + i])
            expert.linear_fc2.weight.copy_(fc2[rank * local + i])


def inputs(d: dict, rank: int, skew: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's [seq, micro, hidden] input and the probe its loss weights the output with."""
    gen = torch.Generator().manual_seed(SEED + 1 + rank)
    x = torch.randn(d["seq"], d["micro"], d["hidden"], generator=gen)
    return x, torch.randn(x.shape, generator=gen)


def step(layer, x: torch.Tensor, probe: torch.Tensor) -> float:
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    loss = (out * probe).sum()
    loss.backward()
    return loss.detach().item()


def routed_rows(layer, x: torch.Tensor, ep: int) -> dict:
    """The engine's all-to-all volume for this input, from the router's decision: rows this rank sends
    to other ranks and rows it receives from them (every rank's counts all-gathered)."""
    with torch.no_grad():
        _, routing_map = layer.router(x.reshape(-1, x.shape[-1]))
    per_expert = routing_map.sum(dim=0).to(torch.int64)
    every = [torch.empty_like(per_expert) for _ in range(dist.get_world_size())]
    dist.all_gather(every, per_expert)
    from megatron.core import parallel_state as ps

    ep_ranks = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
    me, local = ps.get_expert_model_parallel_rank(), per_expert.numel() // ep
    counts = torch.stack([every[r] for r in ep_ranks]).view(ep, ep, local).sum(dim=2)  # [src, dst]
    sent = int(counts[me].sum() - counts[me, me])
    received = int(counts[:, me].sum() - counts[me, me])
    return {"sent_rows": sent, "received_rows": received, "experts": per_expert.numel()}
