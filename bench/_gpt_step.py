"""The megatron-core GPT training step that bench/level0_overhead.py and bench/profile_overhead.py time:
the model in megatron's DDP with its Adam, fixed batches, one step as megatron.training takes it."""

from __future__ import annotations

import logging
import math
import os
import statistics

import torch

from hyper_adaptor.testing.gpt import forward_step
from hyper_adaptor.testing.measure import free_port

# The model: small enough that a step is well under a second on a 2-core CPU, large enough to time.
HIDDEN = 256
HEADS = 8
FFN = 1024
LAYERS = 4
SEQ = 128
MICRO_BATCH = 2
NUM_MICRO = 2
VOCAB = 1024
SEED = 1234

def sink_fork_warning() -> None:
    """Without level 0's logging patch megatron warns on every RNG-tracker fork ("CPU RNG state changed
    within GPU RNG context"); with it the record is dropped. Both configurations send that logger's
    records to a NullHandler, so that the terminal is not flooded with it in the minimum configuration
    (level 0 never emits it)."""
    from hyper_adaptor.patches.compat import megatron_core

    log = logging.getLogger(megatron_core.RNG_MODULE)
    if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
        log.addHandler(logging.NullHandler())
    log.propagate = False


def init_distributed() -> bool:
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    return True


def init_model_parallel() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.get_cuda_rng_tracker().reset()
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)


def build_training():
    """GPTModel (local spec) in Megatron's DDP, with megatron's Adam; returns (config, model, optimizer)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        # fused kernels are level 1; level 0 runs megatron's unfused torch paths
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=True,
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, clip_grad=1.0, params_dtype=torch.float32),
        [ddp],
    )
    config.finalize_model_grads_func = finalize_model_grads
    return config, ddp, optimizer


def make_batches():
    """NUM_MICRO fixed micro-batches (data loading is not what is compared)."""
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (NUM_MICRO * MICRO_BATCH, SEQ + 1), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ).contiguous()
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5
    return [
        {
            "tokens": tokens[i : i + MICRO_BATCH, :-1].contiguous(),
            "labels": tokens[i : i + MICRO_BATCH, 1:].contiguous(),
            "position_ids": position_ids,
            "attention_mask": mask,
        }
        for i in range(0, NUM_MICRO * MICRO_BATCH, MICRO_BATCH)
    ]


def train_step(model, optimizer, batches) -> float:
    """One step as megatron.training's train_step takes it; returns the mean loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward = get_forward_backward_func()
    losses = forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=model,
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    optimizer.step()
    return float(sum(d["lm loss"] for d in losses))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(times_s: list[float]) -> dict:
    ms = [t * 1000.0 for t in times_s]
    return {
        "median_ms": statistics.median(ms),
        "p10_ms": percentile(ms, 0.10),
        "p90_ms": percentile(ms, 0.90),
        "mean_ms": statistics.fmean(ms),
        "steps_timed": len(ms),
    }
