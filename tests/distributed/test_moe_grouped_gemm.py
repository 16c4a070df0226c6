"""``--moe-grouped-gemm`` on a whole megatron-core MoE GPT: with the flag against without it.

A 2-layer GPT (RMSNorm, SwiGLU experts, 4 experts, top-2, aux-loss router, local spec, dropless
allgather token dispatcher: megatron's alltoall one hands gloo split sizes it rejects on CPU) on a
2-rank gloo world with expert parallelism 2 (two local experts per rank, dense layers data-parallel
over both ranks), megatron DDP + Adam, 3 steps. Runs in one world, in order:

- ``level0`` and ``level0-with-flag``: megatron's own path, and the same with ``--moe-grouped-gemm``
  at ``--optimization-level 0`` (a notice, nothing applied): must be bit-identical;
- ``level1`` / ``level1-bf16``: level 1 without the flag (gradient accumulation fusion on, as
  megatron's default), the reference for
- ``grouped`` / ``grouped-bf16``: level 1 with ``--moe-grouped-gemm``.

Tolerances: fp32 losses 1e-6 relative, gradients and parameters 1e-6 absolute (the grouped path runs
the same per-expert GEMMs, so only a GEMM's blocking could reorder a sum); bf16 losses 1e-3
relative, each gradient (fp32 main_grad) 1e-2 relative in norm, parameters 1e-3 absolute (room for
one bf16 rounding of an activation to flip). The bf16 gradients are bounded relative to their norm:
the router's and the RMSNorm weights' gradients stay below 1e-3, so an absolute 1e-3 let a 10% error
through in 17 of the 66 gradients of a rank. On the 2-core CPU VM of this project both dtypes came
out bit-identical.
"""

from __future__ import annotations

import types

import pytest
import torch

from hyper_adaptor.testing import run_world
from tests.distributed.gpt_parity import compare, missed_wrong_gradients

pytestmark = pytest.mark.distributed

SEQ, VOCAB, MICRO_BATCH, GLOBAL_BATCH, EXPERTS = 32, 128, 2, 8, 4
FP32 = dict(loss_rtol=1e-6, grad_atol=1e-6, param_atol=1e-6)
BF16 = dict(loss_rtol=1e-3, grad_rtol=1e-2, param_atol=1e-3)


def _build(ep: int, bf16: bool, grad_fusion: bool, flag: bool, seed: int):
    import torch.nn.functional as F

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=True,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=96, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, expert_model_parallel_size=ep,
        moe_grouped_gemm=flag, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=bf16, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=grad_fusion, persist_layer_norm=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=flag, normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0, bf16=bf16, params_dtype=dtype),
        [ddp],
    )
    return config, ddp, optimizer


def train(rank: int, world_size: int, *, level: int | None, flag: bool, bf16: bool, steps: int = 3,
          seed: int = 1234) -> dict:
    import torch.distributed as dist

    from hyper_adaptor.megatron_adaptor import ADAPTOR
    from hyper_adaptor.ops import backend

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if level is not None:  # what megatron.training's validate_args does with these flags
        args = types.SimpleNamespace(transformer_impl="local", optimization_level=level, num_experts=EXPERTS,
                                     moe_grouped_gemm=flag, gradient_accumulation_fusion=level >= 1)
        ADAPTOR.prepare(args)
        ADAPTOR.apply_features(args)
        flag = args.moe_grouped_gemm
    calls_before = dict(backend.call_counts().get("grouped_gemm", {}))
    config, ddp, optimizer = _build(world_size, bf16, grad_fusion=level is not None and level >= 1, flag=flag,
                                    seed=seed)
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    mine = tokens.chunk(world_size)[rank]
    micro = [
        {"tokens": mb[:, :-1], "labels": mb[:, 1:], "position_ids": torch.arange(SEQ).expand(mb.shape[0], SEQ),
         "attention_mask": torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5}
        for mb in mine.split(MICRO_BATCH)
    ]

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        return output, lambda out: (out.float().mean(), {"lm loss": out.float().mean().detach()})

    history = {"loss": [], "grads": [], "params": []}
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter(micro), model=ddp,
                                  num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                                  forward_only=False)
        loss = torch.stack([d["lm loss"] for d in losses]).sum()
        dist.all_reduce(loss)
        history["loss"].append(loss.item() / world_size)
        # local names: expert k on this rank is the same expert in every run of this layout
        history["grads"].append({n: p.main_grad.detach().float().clone() for n, p in ddp.named_parameters()})
        assert optimizer.step()[0]
        history["params"].append({n: p.detach().float().clone() for n, p in ddp.named_parameters()})
    ps.destroy_model_parallel()
    after = backend.call_counts().get("grouped_gemm", {})
    history["grouped_gemm_calls"] = {k: after.get(k, 0) - calls_before.get(k, 0) for k in after}
    return history


def train_many(rank: int, world_size: int, runs: dict) -> dict:
    return {name: train(rank, world_size, **kwargs) for name, kwargs in runs.items()}


@pytest.fixture(scope="module")
def runs():
    # Order matters: applied features stay applied in the worker processes.
    layouts = {
        "level0": dict(level=None, flag=False, bf16=False),
        "level0-with-flag": dict(level=0, flag=True, bf16=False),
        "level1": dict(level=1, flag=False, bf16=False),
        "level1-bf16": dict(level=1, flag=False, bf16=True),
        "grouped": dict(level=1, flag=True, bf16=False),
        "grouped-bf16": dict(level=1, flag=True, bf16=True),
    }
    return run_world(2, "tests.distributed.test_moe_grouped_gemm:train_many", timeout=400, runs=layouts)


@pytest.mark.parametrize("rank", [0, 1])
def test_grouped_gemm_matches_megatron_fp32(runs, rank):
    got, want = runs[rank]["grouped"], runs[rank]["level1"]
    assert compare(want, got, **FP32) == []
    assert got["loss"][2] < got["loss"][0]  # it trains
    assert any("local_experts.1.linear_fc2" in n for n in got["grads"][0])  # two local experts per rank


@pytest.mark.parametrize("rank", [0, 1])
def test_grouped_gemm_bf16_close_to_megatron_bf16(runs, rank):
    assert compare(runs[rank]["level1-bf16"], runs[rank]["grouped-bf16"], **BF16) == []


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tolerances_catch_one_gradient_off_by_10_percent(runs, dtype):
    suffix, tolerance = ("", FP32) if dtype == "fp32" else ("-bf16", BF16)
    for rank in (0, 1):
        want, got = runs[rank]["level1" + suffix], runs[rank]["grouped" + suffix]
        assert missed_wrong_gradients(want, got, tolerance) == [], rank
        assert missed_wrong_gradients(want, got, tolerance, factor=0.9) == [], rank


def test_grouped_gemm_really_ran_and_level1_without_flag_did_not(runs):
    for rank in (0, 1):
        # fc1 + fc2 of 2 MoE layers, 2 micro-batches per rank, 3 steps (each backward is inside its call)
        assert runs[rank]["grouped"]["grouped_gemm_calls"]["fast"] == 2 * 2 * 2 * 3
        assert sum(runs[rank]["level1"]["grouped_gemm_calls"].values()) == 0


def test_level0_with_the_flag_is_megatron_bit_for_bit(runs):
    for rank in (0, 1):
        want, got = runs[rank]["level0"], runs[rank]["level0-with-flag"]
        assert got["loss"] == want["loss"]
        assert compare(want, got, loss_rtol=0.0, grad_atol=0.0, param_atol=0.0) == []
        assert sum(got["grouped_gemm_calls"].values()) == 0
