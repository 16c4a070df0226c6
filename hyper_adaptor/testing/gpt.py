"""megatron-core GPT pieces shared by the test suite and the benchmarks (``bench/`` never imports ``tests/``).

* :func:`forward_step`: megatron's forward-step function for a ``GPTModel``, with the mean token loss;
* :func:`build_gpt_moe`: a GPT whose every layer is an MoE, under expert parallelism, in megatron's DDP +
  distributed optimizer or in --use-hsdp's wrapper at the same layout, with megatron's Adam — the model
  tests/distributed/hsdp_expert_checks.py trains and bench/_moe_memory.py measures.

megatron is imported inside the functions only: a rank imports the one-line adaptor before megatron.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist


def forward_step(data_iterator, model):
    """One micro-batch (a dict of tokens, labels, position ids and attention mask) through ``model``; its
    loss is the mean of the per-token losses, reported as "lm loss"."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def hsdp_args(run: dict, tp: int, ep: int, etp: int, experts: int) -> types.SimpleNamespace:
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


def build_gpt_moe(run: dict, dims: dict, *, seed: int, clip: float):
    """Initialise megatron's parallel state for ``run`` and build the model: (config, model, chunk, optimizer).

    ``run``: ``ep``; optional ``tp``, ``etp`` (default ``tp``), ``dispatcher`` (megatron's token dispatcher,
    default "alltoall"), ``fp16`` (the initial loss scale), ``hsdp`` (a level: --use-hsdp's wrapper instead of
    megatron's DDP + distributed optimizer), ``shard`` and ``comm_async`` (HSDP's shard size and async switch).
    ``dims``: layers, hidden, heads, ffn, experts, topk, moe_ffn, seq, vocab. Every layer is an MoE (local
    spec, aux-loss router, no linear biases, no dropout, no fusions); ``seed`` seeds the weights, ``clip`` is
    Adam's gradient clipping.
    """
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
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=dims["layers"], hidden_size=dims["hidden"], num_attention_heads=dims["heads"],
        ffn_hidden_size=dims["ffn"], add_bias_linear=False, activation_func=F.gelu, num_moe_experts=dims["experts"],
        moe_router_topk=dims["topk"], moe_ffn_hidden_size=dims["moe_ffn"],
        moe_token_dispatcher_type=run.get("dispatcher", "alltoall"), moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, fp16=fp16,
        params_dtype=torch.float16 if fp16 else torch.float32, pipeline_dtype=torch.float16 if fp16 else torch.float32,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=dims["experts"]),
                     vocab_size=dims["vocab"], max_sequence_length=dims["seq"],
                     share_embeddings_and_output_weights=True)
    if fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    hsdp = run.get("hsdp")
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=not hsdp)
    if hsdp:
        from hyper_adaptor.patches.hsdp import data_parallel
        from hyper_adaptor.patches.hsdp.patches import hsdp_kwargs

        wrapper = data_parallel.make_wrapper_class(hsdp_kwargs(hsdp_args(run, tp, ep, etp, dims["experts"])))
        chunk = wrapper(config=config, ddp_config=ddp_config, module=model)
    else:
        chunk = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=clip,
                        use_distributed_optimizer=not hsdp, fp16=fp16, initial_loss_scale=run.get("fp16"),
                        params_dtype=torch.float16 if fp16 else torch.float32, hysteresis=1),
        [chunk],
    )
    return config, model, chunk, optimizer
