"""Rank code for test_moe_dispatchers.py: megatron-core's ``MoELayer`` under one layout after another.

Every layout builds the layer from megatron's local spec (4 experts, top-2, aux-loss router, GeLU
experts without bias), loads one set of full weights (each rank its experts and its expert-tensor-
parallel shard), runs one forward and backward on its part of the tokens and returns what a
single process can be compared with: its output, the input gradient, the loss summed over the world,
the router gradient summed over the world and each local expert's weight gradient summed over the
expert-data-parallel group. The single-process reference is the same layer at EP 1 / TP 1 in a
world of one, called once per data-parallel chunk (the aux loss is per micro-batch and rank).
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.distributed as dist

HIDDEN, FFN, EXPERTS, TOPK, SEQ, MICRO = 16, 24, 4, 2, 8, 2
SEED = 4321


def full_weights() -> dict:
    gen = torch.Generator().manual_seed(SEED)
    return {"router": torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.5,
            "fc1": torch.randn(EXPERTS, FFN, HIDDEN, generator=gen) * 0.3,
            "fc2": torch.randn(EXPERTS, HIDDEN, FFN, generator=gen) * 0.3,
            "shared_fc1": torch.randn(FFN, HIDDEN, generator=gen) * 0.3,
            "shared_fc2": torch.randn(HIDDEN, FFN, generator=gen) * 0.3}


def chunk(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel chunk ``index``: the layer's input [SEQ, MICRO, HIDDEN] and the probe the loss
    weights its output with."""
    gen = torch.Generator().manual_seed(SEED + 1 + index)
    return torch.randn(SEQ, MICRO, HIDDEN, generator=gen), torch.randn(SEQ, MICRO, HIDDEN, generator=gen)


def _build(ep: int, tp: int, etp: int, dispatcher: str, grouped: bool, extra: dict):
    import torch.nn.functional as F

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    settings = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN, add_bias_linear=False,
        activation_func=F.gelu, num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=FFN,
        moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1, moe_grouped_gemm=grouped, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    config = TransformerConfig(**{**settings, **extra})
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=grouped)
    layer = spec.submodules.mlp(config=config, layer_number=1)
    full = full_weights()
    ep_rank, etp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    local = EXPERTS // ep
    with torch.no_grad():
        layer.router.weight.copy_(full["router"])
        for i, expert in enumerate(layer.experts.local_experts):
            g = ep_rank * local + i
            expert.linear_fc1.weight.copy_(full["fc1"][g].chunk(etp, 0)[etp_rank])
            expert.linear_fc2.weight.copy_(full["fc2"][g].chunk(etp, 1)[etp_rank])
        if layer.shared_experts is not None:  # tensor-parallel like a dense MLP
            tp_rank = ps.get_tensor_model_parallel_rank()
            layer.shared_experts.linear_fc1.weight.copy_(full["shared_fc1"].chunk(tp, 0)[tp_rank])
            layer.shared_experts.linear_fc2.weight.copy_(full["shared_fc2"].chunk(tp, 1)[tp_rank])
    return layer


def _step(layer, index: int, tp: int, tp_rank: int):
    x, probe = chunk(index)
    if tp > 1:  # sequence parallel: each tensor-parallel rank holds its part of the sequence
        x, probe = x.chunk(tp, 0)[tp_rank], probe.chunk(tp, 0)[tp_rank]
    x = x.clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    loss = (out * probe).sum()
    loss.backward()
    return loss.detach(), out.detach(), x.grad


def _expert_grads(layer, ep: int, etp: int) -> dict:
    from megatron.core import parallel_state as ps

    local, ep_rank = EXPERTS // ep, ps.get_expert_model_parallel_rank()
    grads = {}
    for i, expert in enumerate(layer.experts.local_experts):
        for name in ("linear_fc1", "linear_fc2"):
            grad = getattr(expert, name).weight.grad.clone()
            dist.all_reduce(grad, group=ps.get_expert_data_parallel_group())
            grads[(ep_rank * local + i, name)] = grad
    return {"grads": grads, "experts_here": [ep_rank * local + i for i in range(local)],
            "etp_rank": ps.get_expert_tensor_parallel_rank(), "etp": etp}


def layout(rank: int, world_size: int, *, ep: int, tp: int = 1, etp: int = 1, dispatcher: str = "alltoall",
           grouped: bool = False, extra: dict | None = None) -> dict:
    from hyper_adaptor.ops import backend

    from megatron.core import parallel_state as ps

    before = sum(backend.call_counts().get("grouped_gemm", {}).values())
    layer = _build(ep, tp, etp, dispatcher, grouped, extra or {})
    dp_rank, tp_rank = ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank()
    loss, out, x_grad = _step(layer, dp_rank, tp, tp_rank)
    dist.all_reduce(loss)
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    result = {"loss": loss, "out": out, "x_grad": x_grad, "router_grad": router_grad, "chunk": dp_rank,
              "tp": tp, "tp_rank": tp_rank, **_expert_grads(layer, ep, etp),
              "experts": type(layer.experts).__name__,
              "grouped_gemm_calls": sum(backend.call_counts().get("grouped_gemm", {}).values()) - before}
    dist.barrier()
    ps.destroy_model_parallel()
    return result


def reference(rank: int, world_size: int, chunks: int, variants: dict) -> dict:
    """EP 1 / TP 1 in a world of one, for each variant (extra config): per chunk its loss, output and
    input gradient, and every expert's and the router's gradient of that chunk's loss alone."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return {name: _reference(chunks, extra) for name, extra in variants.items()}


def _reference(chunks: int, extra: dict) -> list:
    from megatron.core import parallel_state as ps

    layer = _build(1, 1, 1, "alltoall", False, extra)
    result = []
    for index in range(chunks):
        layer.zero_grad()
        loss, out, x_grad = _step(layer, index, 1, 0)
        experts = {(g, name): getattr(expert, name).weight.grad.clone()
                   for g, expert in enumerate(layer.experts.local_experts) for name in ("linear_fc1", "linear_fc2")}
        result.append({"loss": loss, "out": out, "x_grad": x_grad, "router_grad": layer.router.weight.grad.clone(),
                       "grads": experts})
    ps.destroy_model_parallel()
    return result


@contextlib.contextmanager
def wrap_off(name: str):
    """torch.distributed's own ``name`` where level 0 wrapped it (also where megatron bound it by value)."""
    from hyper_adaptor.megatron_adaptor import ADAPTOR

    wrapper, original = getattr(dist, name), ADAPTOR.manager.original(f"torch.distributed.{name}")
    swapped = []
    for namespace in [vars(dist)] + [vars(m) for n, m in list(sys.modules.items())
                                     if n.startswith("megatron.") and m is not None]:
        for key, value in list(namespace.items()):
            if value is wrapper:
                namespace[key] = original
                swapped.append((namespace, key))
    try:
        yield
    finally:
        for namespace, key in swapped:
            namespace[key] = wrapper


def _level(level: int, grouped: bool) -> bool:
    """What megatron.training's validate_args does with ``--optimization-level`` and
    ``--moe-grouped-gemm``; returns the flag as the model is built with it."""
    from hyper_adaptor.megatron_adaptor import ADAPTOR

    args = types.SimpleNamespace(transformer_impl="local", optimization_level=level, num_experts=EXPERTS,
                                 moe_grouped_gemm=grouped, gradient_accumulation_fusion=False)
    ADAPTOR.prepare(args)
    ADAPTOR.apply_features(args)
    return args.moe_grouped_gemm


def layouts(rank: int, world_size: int, runs: dict) -> dict:
    """Each run in order: ``{"ep": .., "tp": .., "etp": .., "dispatcher": .., "level": 0 | 1,
    "grouped": bool, "unfixed": bool}``; a run that raises gives its error text. Level-1 runs go last:
    applied features stay applied in the process."""
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {}
    for name, run in runs.items():
        run = dict(run)
        level, unfixed = run.pop("level", None), run.pop("unfixed", False)
        if level is not None:
            run["grouped"] = _level(level, run.get("grouped", False))
        context = wrap_off("all_to_all_single") if unfixed else contextlib.nullcontext()
        try:
            with context:
                results[name] = layout(rank, world_size, **run)
        except Exception as error:  # the test reads which error
            results[name] = f"{type(error).__name__}: {error}"
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
    return results
