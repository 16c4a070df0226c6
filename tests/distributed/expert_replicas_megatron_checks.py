"""Rank code for test_expert_replicas_megatron.py: megatron's ``MoELayer`` on the engine with and without
hot-expert replicas, trained a few SGD steps on a skewed router.

8 experts, top-2, SwiGLU experts, aux-loss router, local spec, fp32. The router is skewed by its
weights: every token carries a constant feature that experts 0 and 1 (both on EP rank 0) score high,
so they take most tokens. Each step: the layer's forward on this rank's data, the backward, the
replica gradients to their owners (``reduce_replica_grads``, what the wrap of megatron DDP's
``finish_grad_sync`` does), the router's gradient summed over the data-parallel ranks and the
experts' over expert-data-parallel (megatron DDP's reduction, by hand), an SGD step, then
``after_step`` (what the wrap of megatron's ``train_step`` does: a plan every ``interval`` steps, the
owners' weights to the replicas).
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist

HIDDEN, FFN, EXPERTS, TOPK, SEQ, MICRO = 16, 12, 8, 2, 16, 2
SEED, STEPS, LR = 97, 5, 0.05
SKEW = 3.0   # the constant feature's value: experts 0 and 1 score it high


def _weights() -> dict:
    gen = torch.Generator().manual_seed(SEED)
    router = torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.3
    router[:, 0] = -1.0
    router[:2, 0] = 1.0
    return {"router": router,
            "fc1": torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=gen) * 0.3,
            "fc2": torch.randn(EXPERTS, HIDDEN, FFN, generator=gen) * 0.3}


def _data(step: int, rank: int):
    gen = torch.Generator().manual_seed(SEED + 1000 * step + rank + 1)
    x = torch.randn(SEQ, MICRO, HIDDEN, generator=gen)
    x[..., 0] = SKEW
    return x, torch.randn(SEQ, MICRO, HIDDEN, generator=gen)


@contextlib.contextmanager
def _engine(replicas: int, interval: int):
    """The feature's dispatcher patches (the engine, with ``replicas`` replicas), for one run."""
    from hyper_adaptor.patch_manager import PatchManager
    from hyper_adaptor.patches.expert import dispatcher

    manager = PatchManager()
    # the dispatcher and its expert step only: this layer is trained by hand, not by megatron.training
    manager.register_all(dispatcher.patches(types.SimpleNamespace(moe_dispatch_chunks=1))[:2] if not replicas else
                         dispatcher.patches(types.SimpleNamespace(moe_dispatch_chunks=1,
                                                                  moe_hot_expert_replicas=replicas,
                                                                  moe_replica_interval=interval))[:2])
    with manager.applied():
        yield


def _build(ep: int, extra: dict):
    import torch.nn.functional as F

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    torch.manual_seed(SEED)   # the shared expert's initial weights: the same in every run
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN, add_bias_linear=False,
        activation_func=F.silu, gated_linear_unit=True, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_ffn_hidden_size=FFN, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, **extra)
    layer = get_gpt_layer_local_spec(num_experts=EXPERTS).submodules.mlp(config=config, layer_number=1)
    full, local = _weights(), EXPERTS // ep
    first = ps.get_expert_model_parallel_rank() * local
    with torch.no_grad():
        layer.router.weight.copy_(full["router"])
        for i, expert in enumerate(layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(full["fc1"][first + i])
            expert.linear_fc2.weight.copy_(full["fc2"][first + i])
    return layer, first


def _train(rank: int, ep: int, replicas: int, interval: int, reduce: bool, extra: dict) -> dict:
    from hyper_adaptor.patches.expert import replicas as seam

    from megatron.core import parallel_state as ps

    layer, first = _build(ep, extra)
    losses, lines = [], []
    for step in range(STEPS):
        x, probe = _data(step, rank)
        out, _ = layer(x)
        loss = (out * probe).sum() / (SEQ * MICRO)
        loss.backward()
        if reduce:
            seam.reduce_replica_grads(layer)
        for name, p in layer.named_parameters():   # dense: the data-parallel group is the world here
            if "local_experts" not in name and p.grad is not None:
                dist.all_reduce(p.grad)
        expert_params = [p for e in layer.experts.local_experts for p in e.parameters()]
        for p in expert_params:
            dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())
        with torch.no_grad():
            for p in layer.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
                    p.grad = None
        lines += seam.after_step(layer)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total)
    experts = {first + i: [p.detach().clone() for p in e.parameters()]
               for i, e in enumerate(layer.experts.local_experts)}
    routed = [routing.manager.plan.num_replicas for _, routing in seam.replica_layers(layer)]
    result = {"losses": torch.stack(losses), "router": layer.router.weight.detach().clone(), "experts": experts,
              "lines": lines, "replicas_in_plan": routed, "ep_rank": ps.get_expert_model_parallel_rank()}
    dist.barrier()
    ps.destroy_model_parallel()
    return result


def replica_runs(rank: int, world_size: int, runs: dict) -> dict:
    """Each run: ``{"ep": .., "replicas": R, "interval": N, "reduce": bool, "extra": {config}}``; a run that
    raises gives its error text."""
    import hyper_adaptor.megatron_adaptor  # noqa: F401  (megatron importable on this platform)

    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {}
    for name, run in runs.items():
        try:
            with _engine(run["replicas"], run["interval"]):
                results[name] = _train(rank, run["ep"], run["replicas"], run["interval"], run.get("reduce", True),
                                       run.get("extra", {}))
        except Exception as error:  # the test reads which error
            import traceback

            results[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
    return results
