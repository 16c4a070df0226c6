"""Rank code for test_hsdp_experts.py: a megatron-core GPT with MoE layers under expert parallelism,
trained a few Adam steps with megatron's DDP + distributed optimizer and then with --use-hsdp's
wrapper (hyper_adaptor/patches/hsdp) at the same layout, in one world.

Every run starts from the same weights (same seeds, same layout) and sees the same batches; each
returns its per-step loss and gradient norm (what megatron.training logs) and this rank's parameters
after the last step (TP/EP-local, whole over data parallel), so the test compares HSDP with DDP on
every rank. The DDP runs come first: HSDP's patches, once applied, stay applied in the process.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from tests.distributed.gpt_parity import MICRO_BATCH, SEQ, VOCAB, _micro_batch_dicts

LAYERS, EXPERTS, TOPK, GLOBAL_BATCH, STEPS, SEED = 2, 4, 2, 16, 3, 1234
CLIP = 0.5  # below the first steps' gradient norms (about 0.57 and 0.55): clipping acts, then does not
# the model's sizes; a run's "dims" overrides some (bench/_moe_memory.py builds a larger one)
DIMS = dict(layers=LAYERS, hidden=64, heads=4, ffn=128, experts=EXPERTS, topk=TOPK, moe_ffn=96, seq=SEQ, vocab=VOCAB)


def _batches(step: int) -> list:
    g = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return [tokens[i : i + MICRO_BATCH] for i in range(0, GLOBAL_BATCH, MICRO_BATCH)]


def _hsdp_args(run: dict, tp: int, ep: int, etp: int, experts: int = EXPERTS) -> types.SimpleNamespace:
    """--use-hsdp's flags for ``run``, checked and applied as megatron.training's validate_args would."""
    from hyper_adaptor.megatron_adaptor import ADAPTOR

    args = types.SimpleNamespace(
        transformer_impl="local", optimization_level=2, use_hsdp=True, hsdp_optimizer_level=run["hsdp"],
        hsdp_shard_size=run.get("shard", -1), hsdp_threshold_kb=0.0, hsdp_comm_async=bool(run.get("comm_async")),
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, num_experts=experts, fp16=bool(run.get("fp16")))
    ADAPTOR.prepare(args, say=False)
    ADAPTOR.apply_features(args)
    return args


def _build(run: dict):
    import torch.nn.functional as F

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    tp, ep, etp = run.get("tp", 1), run["ep"], run.get("etp", run.get("tp", 1))
    fp16 = bool(run.get("fp16"))
    d = {**DIMS, **run.get("dims", {})}
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)
    config = TransformerConfig(
        num_layers=d["layers"], hidden_size=d["hidden"], num_attention_heads=d["heads"], ffn_hidden_size=d["ffn"],
        add_bias_linear=False, activation_func=F.gelu, num_moe_experts=d["experts"], moe_router_topk=d["topk"],
        moe_ffn_hidden_size=d["moe_ffn"],
        moe_token_dispatcher_type=run.get("dispatcher", "alltoall"), moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, fp16=fp16,
        params_dtype=torch.float16 if fp16 else torch.float32, pipeline_dtype=torch.float16 if fp16 else torch.float32,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=d["experts"]),
                     vocab_size=d["vocab"], max_sequence_length=d["seq"], share_embeddings_and_output_weights=True)
    if fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    hsdp = run.get("hsdp")
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=not hsdp)
    if hsdp:
        from hyper_adaptor.patches.hsdp import data_parallel
        from hyper_adaptor.patches.hsdp.patches import hsdp_kwargs

        wrapper = data_parallel.make_wrapper_class(hsdp_kwargs(_hsdp_args(run, tp, ep, etp, d["experts"])))
        if run.get("wrong_expert_scale"):  # the negative control: experts averaged over their own group only
            right = data_parallel._expert_kwargs
            data_parallel._expert_kwargs = lambda kw, *groups: {**right(kw, *groups), "grad_scale": 1.0}
            try:
                chunk = wrapper(config=config, ddp_config=ddp_config, module=model)
            finally:
                data_parallel._expert_kwargs = right
        else:
            chunk = wrapper(config=config, ddp_config=ddp_config, module=model)
    else:
        chunk = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=CLIP,
                        use_distributed_optimizer=not hsdp, fp16=fp16, initial_loss_scale=run.get("fp16"),
                        params_dtype=torch.float16 if fp16 else torch.float32, hysteresis=1),
        [chunk],
    )
    return config, model, chunk, optimizer


def _local(param) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def _layout(model) -> dict:
    """Which group each kind of parameter is sharded over: (mesh size, sharded?) per kind."""
    from torch.distributed.tensor import DTensor

    out = {}
    for param in model.parameters():
        kind = "expert" if not getattr(param, "allreduce", True) else "dense"
        if isinstance(param, DTensor):
            out.setdefault(kind, set()).add((param.device_mesh.size(), any(p.is_shard() for p in param.placements)))
    return {k: sorted(v) for k, v in out.items()}


def train(run: dict) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config, model, chunk, optimizer = _build(run)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss  # (fp16: the loss scaler's; 1 otherwise)
    if run.get("load"):
        _load(run, model, chunk)
    if run.get("overflow_in"):
        result = _found_inf(run["overflow_in"], optimizer)
        ps.destroy_model_parallel()
        return result
    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    num_micro = GLOBAL_BATCH // MICRO_BATCH // dp_size

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    losses, norms, scales, skipped = [], [], [], []
    for step in range(run.get("steps", STEPS)):
        mine = _micro_batch_dicts(_batches(step))[dp_rank * num_micro : (dp_rank + 1) * num_micro]
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(mine), model=chunk,
                                          num_microbatches=num_micro, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                                          forward_only=False)
        loss = torch.stack([d["lm loss"] for d in out]).sum()
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        losses.append(loss.item() / dp_size)
        scales.append(float(optimizer.get_loss_scale()))
        ok, grad_norm, _ = optimizer.step()
        skipped.append(not ok)  # fp16: an overflow anywhere skips the step on every rank
        norms.append(float(grad_norm) if ok else float("nan"))
    if run.get("save"):
        _save(run, model)
    params = {name: _local(p) for name, p in model.named_parameters()}
    result = {"loss": losses, "grad_norm": norms, "loss_scale": scales, "skipped": skipped, "params": params,
              "layout": _layout(model),
              "optimizers": len(getattr(optimizer, "chained_optimizers", [optimizer]))}
    ps.destroy_model_parallel()
    return result


def _found_inf(kind: str, optimizer) -> dict:
    """fp16: an inf in one ``kind`` ("dense" / "expert") gradient shard of rank 0 only; with HSDP's
    shards every rank must skip the step (megatron's chained optimizer: the dense and the expert
    optimizer each check their own gradients, over their own model-parallel groups)."""
    from torch.distributed.tensor import DTensor

    planted = False
    for sub in optimizer.chained_optimizers:
        for group in sub.float16_groups:
            for param in group:
                grad = torch.zeros_like(param)
                local = grad._local_tensor if isinstance(grad, DTensor) else grad
                is_expert = not getattr(param, "allreduce", True)
                if dist.get_rank() == 0 and not planted and is_expert == (kind == "expert") and local.numel():
                    local.view(-1)[0] = float("inf")
                    planted = True
                param.grad = grad
    return {"found_inf": bool(optimizer.prepare_grads()), "planted": planted}


def _model_state(run: dict, model):
    """megatron's description of the model's checkpoint entries; HSDP's as --use-hsdp writes them
    (this rank's rows at their global offsets: hyper_adaptor/patches/hsdp/checkpoint.py)."""
    state = model.sharded_state_dict()
    if run.get("hsdp"):
        from hyper_adaptor.patches.hsdp.checkpoint import localize_sharded_state_dict

        state = localize_sharded_state_dict(state)
    return state


def _save(run: dict, model) -> None:
    import os

    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(run["save"], exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_model_state(run, model), run["save"])
    dist.barrier()


def _load(run: dict, model, chunk) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_model_state(run, model), run["load"])
    (chunk if run.get("hsdp") else model).load_state_dict(loaded)


def parity(rank: int, world_size: int, runs: dict) -> dict:
    """``runs``: name -> run (ep, tp, etp, hsdp level or None, shard size); DDP runs first."""
    dist.init_process_group("gloo")
    results = {}
    for name, run in runs.items():
        try:
            results[name] = train(run)
        except Exception as error:  # a refused run is a result (today's code refuses them all)
            import traceback

            results[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}"
            break  # the other ranks may be stuck in a collective this one left
    return results
