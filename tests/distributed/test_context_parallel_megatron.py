"""Context parallel on megatron's local spec (``--context-parallel-size``, level 2) against one process.

A megatron-core GPT with RoPE, SwiGLU, RMSNorm and grouped-query attention (4 query heads, 2 key/value
groups) trains 2 Adam steps on the same global batch, cut per CP rank by megatron's own
``get_batch_on_this_cp_rank`` (load-balanced chunks); the attention of every layer runs through
hyper_adaptor's context-parallel engine, everything else (RoPE slice, loss scaling, gradient reduction
over data x context) is megatron's. Reference: the same model in one process (CP 1), same initial weights.

Tolerances (fp32): losses 1e-5 relative; each gradient 1e-4 relative in norm and parameters 1e-4
absolute — the block-wise softmax (log-sum-exp merge) reorders sums, as level-1 flash attention does
(tests/distributed/test_level1_parity.py); ``missed_wrong_gradients`` shows a 10% error in any one
gradient fails. bf16: ``gpt_parity.BF16`` at the first step.
"""

import pytest

from hyper_adaptor.patches.context.attention import ALGORITHMS
from hyper_adaptor.testing import run_world
from tests.distributed.gpt_parity import BF16, SEQ, Layout, compare, missed_wrong_gradients

pytestmark = pytest.mark.distributed

TARGET = "tests.distributed.gpt_parity:train_many"
FP32 = dict(loss_rtol=1e-5, grad_rtol=1e-4, param_atol=1e-4)
# two steps: the second's gradients and Adam update depend on the first's (Adam's first update is the
# gradient's sign), and every step runs each layer's context-parallel attention forward and backward
STEPS = 2
BF16_FIRST_STEP = dict(BF16, grad_steps=1)
LEVEL1 = dict(use_fused_rmsnorm=True, use_fused_swiglu=True, use_fused_rotary_pos_emb=True, use_flash_attn=True,
              gradient_accumulation_fusion=True, normalization="RMSNorm", swiglu=True, bias_swiglu_fusion=True,
              position_embedding_type="rope")
# what megatron.training derives from those flags (tests/distributed/test_level1_parity.py)
LEVEL1_CONFIG = dict(bias_activation_fusion=True, gradient_accumulation_fusion=True)


def _modern(**kwargs) -> dict:
    import torch.nn.functional as F

    return dict(normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, activation_func=F.silu,
                num_query_groups=2, **kwargs)


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_token_dispatcher_type="allgather",
           moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _layout(cp: int = 1, algo: str = "ring", bf16: bool = False, tp: int = 1, pp: int = 1,
            features: dict | None = None, extra: dict | None = None, **layout) -> Layout:
    hierarchical = [2, cp // 2] if algo == "hybrid" else None
    flags = None
    if cp > 1:
        # what megatron.training would hand the adaptor for this command line
        flags = dict(optimization_level=2, context_parallel_size=cp, context_parallel_algo=algo,
                     ulysses_degree_in_cp=2 if algo == "hybrid" else None, num_attention_heads=4,
                     tensor_model_parallel_size=tp, seq_length=SEQ, attention_dropout=0.0, **(features or {}))
    comm_type = ALGORITHMS[algo]["comm_type"] if cp > 1 else None
    return Layout(tp=tp, pp=pp, cp=cp, cp_comm_type=comm_type, hierarchical_cp=hierarchical, steps=STEPS,
                  bf16=bf16, extra=_modern(**(extra or {})), model=dict(position_embedding_type="rope"), features=flags,
                  **layout)


@pytest.fixture(scope="module")
def reference():
    layouts = {"fp32": _layout(), "bf16": _layout(bf16=True), "moe": _layout(extra=MOE, spec=dict(num_experts=4))}
    return run_world(1, TARGET, timeout=300, layouts=layouts)[0]


@pytest.fixture(scope="module")
def two_ranks(reference):
    layouts = {f"CP2-{algo}": _layout(2, algo) for algo in ("ring", "ulysses", "allgather")}
    layouts["CP2-ring-bf16"] = _layout(2, "ring", bf16=True)
    # every level-1 op beside context parallel (--use-flash-attn, fused RoPE on the CP rank's positions, ...)
    layouts["CP2-ring-level1"] = _layout(2, "ring", features=LEVEL1, extra=LEVEL1_CONFIG)
    # full recomputation: each layer's forward, context-parallel attention included, runs again in backward
    layouts["CP2-ulysses-recompute"] = _layout(2, "ulysses", extra=RECOMPUTE)
    moe = _layout(2, "ring", extra=MOE, spec=dict(num_experts=4))
    groups = [(layouts, reference["fp32"]["init"]), ({"CP2-ring-MoE": moe}, reference["moe"]["init"])]
    return run_world(2, "tests.distributed.test_context_parallel_megatron:train_groups", timeout=900, groups=groups)[0]


def train_groups(rank: int, world_size: int, groups: list) -> dict:
    """Layouts that start from different initial weights, in one world: [(layouts, init_params), ...]."""
    from tests.distributed.gpt_parity import train_many

    result = {}
    for layouts, init_params in groups:
        result.update(train_many(rank, world_size, layouts, init_params))
    return result


@pytest.fixture(scope="module")
def four_ranks(reference):
    layouts = {f"CP4-{algo}": _layout(4, algo) for algo in ("ring", "ulysses", "allgather", "hybrid")}
    # TP: against the same TP 2 run at CP 1 (DP 2 here): this harness loads the single-process
    # weights into TP shards by plain chunks, which for SwiGLU's fused fc1 ([gate; up]) is another model
    layouts["TP2"] = _layout(1, tp=2)
    layouts["TP2xCP2-ring"] = _layout(2, "ring", tp=2)
    layouts["PP2xCP2-ulysses"] = _layout(2, "ulysses", pp=2)
    layouts["PP2xVPP2xCP2-ring"] = _layout(2, "ring", pp=2, vpp=2)
    layouts["CP2xDP2-allgather"] = _layout(2, "allgather")
    # sequence parallel: TP's sequence shards inside each CP rank's chunks
    layouts["TP2+SPxCP2-ring"] = _layout(2, "ring", tp=2, sequence_parallel=True)
    return run_world(4, TARGET, timeout=900, layouts=layouts, init_params=reference["fp32"]["init"])[0]


@pytest.mark.parametrize("name", ["CP2-ring", "CP2-ulysses", "CP2-allgather", "CP2-ring-level1",
                                  "CP2-ulysses-recompute"])
def test_cp2_matches_single_process(reference, two_ranks, name):
    assert compare(reference["fp32"], two_ranks[name], **FP32) == []


@pytest.mark.parametrize("name", ["CP4-ring", "CP4-ulysses", "CP4-allgather", "CP4-hybrid", "PP2xCP2-ulysses",
                                  "PP2xVPP2xCP2-ring", "CP2xDP2-allgather"])
def test_cp4_layouts_match_single_process(reference, four_ranks, name):
    assert compare(reference["fp32"], four_ranks[name], **FP32) == []


@pytest.mark.parametrize("name", ["TP2xCP2-ring", "TP2+SPxCP2-ring"])
def test_tp2_cp2_matches_tp2(four_ranks, name):
    assert compare(four_ranks["TP2"], four_ranks[name], **FP32) == []


def test_cp2_moe_matches_single_process(reference, two_ranks):
    assert compare(reference["moe"], two_ranks["CP2-ring-MoE"], **FP32) == []


def test_cp2_bf16_close_to_single_process_bf16(reference, two_ranks):
    assert compare(reference["bf16"], two_ranks["CP2-ring-bf16"], **BF16_FIRST_STEP) == []
    assert two_ranks["CP2-ring-bf16"]["loss"] != reference["fp32"]["loss"]  # it really ran in bf16


def test_tolerance_catches_one_gradient_off_by_10_percent(reference, two_ranks):
    assert missed_wrong_gradients(reference["fp32"], two_ranks["CP2-ring"], FP32) == []
    assert missed_wrong_gradients(reference["bf16"], two_ranks["CP2-ring-bf16"], BF16_FIRST_STEP) == []


def test_the_level1_ops_and_the_block_kernels_ran_beside_context_parallel(two_ranks):
    calls = {op: sum(backends.values()) for op, backends in two_ranks["CP2-ring-level1"]["op_calls"].items()}
    # cumulative in the rank's process: the ring's block attention ran in every CP layout before too
    for op in ("rms_norm", "swiglu", "rope", "attention_with_lse", "attention_lse_backward"):
        assert calls.get(op, 0) > 0, (op, calls)
