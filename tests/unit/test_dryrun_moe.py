"""The dry-run's MoE and attention-input terms, each against a hand-computed case: RoPE's rotated q and k and its
cos / sin, GQA's copies, fp32 RMSNorm's input, the router's aux-loss tensors, the tokens each expert-parallel
rank's experts get (balanced, --moe-token-imbalance, --moe-expert-capacity-factor with and without padding)
and the note the report prints about them. What megatron's own layer saves for these is compared in
tests/unit/test_dryrun_memory.py (test_layer_activations_match_what_megatron_saves)."""

import math

import pytest

import hyper_adaptor.megatron_adaptor  # noqa: F401  (level 0 first: megatron imports on CPU)
from hyper_adaptor.dryrun import memory, parse
from hyper_adaptor.dryrun.layer_tensors import routed_tokens
from hyper_adaptor.dryrun.report import moe_routing
from hyper_adaptor.dryrun.shape import ModelShape

# s=32, b=2, h=64, 4 heads of 16, 4 layers
MODEL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 "
         "--tokenizer-type NullTokenizer --vocab-size 257 --no-bias-gelu-fusion --no-bias-dropout-fusion "
         "--no-bias-swiglu-fusion").split()
# 4 experts, top-2, expert ffn 32, SwiGLU, no biases
MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --swiglu --disable-bias-linear"
PER_HEAD = 32 * 2 * 16            # s x b x head dim: elements of one head's q (or k, or v)


def run(extra="", world=1, model=MODEL):
    args = parse(model + extra.split(), world)
    return args, ModelShape.from_args(args)


def terms(extra="", world=1, moe=False):
    args, shape = run(extra, world)
    return {t.name: t.nbytes for t in memory.recomputed(args, memory.layer_terms(shape, args, moe))}


def test_rope_keeps_the_rotated_q_and_k_and_its_cos_and_sin():
    plain, rope = terms(), terms("--position-embedding-type rope")
    assert "q, k after rope" not in plain
    assert rope["q, k, v"] == plain["q, k, v"] == 12 * PER_HEAD * 4     # v keeps linear_qkv's output alive
    assert rope["q, k after rope"] == (4 + 4) * PER_HEAD * 4           # q and k, fp32
    assert rope["rope cos, sin"] == 4 * 32 * 16 * 4                    # cos and sin of s x 16 dims, per call
    half = terms("--position-embedding-type rope --rotary-percent 0.5 --bf16")
    assert half["rope cos, sin"] == 4 * 32 * 8 * 2
    # selective recompute of core_attn: its checkpoint takes the rotated q and k, the cos / sin are outside it
    kept = terms("--position-embedding-type rope --recompute-granularity selective")
    assert kept["q, k after rope"] == rope["q, k after rope"] and "softmax output" not in kept


def test_gqa_keeps_copies_of_q_and_of_k_v_per_query_head():
    gqa = "--group-query-attention --num-query-groups 2"
    # no RoPE: q copied out of the grouped output, k and v repeated to 4 heads; linear_qkv's output is not kept
    got = terms(gqa)
    assert "q, k, v" not in got
    assert got["q (copied from the groups)"] == 4 * PER_HEAD * 4 and got["k, v per query head"] == 8 * PER_HEAD * 4
    # RoPE: the rotated q (bf16) is the kept copy; the rotated k only feeds the repeat
    got = terms(f"{gqa} --position-embedding-type rope --bf16")
    assert got["q, k after rope"] == 4 * PER_HEAD * 2 and got["k, v per query head"] == 8 * PER_HEAD * 2
    assert "q, k, v" not in got and "q (copied from the groups)" not in got
    # selective recompute: the checkpoint's inputs (q copy, and k, v as views of the 4 + 2 x 2 head output)
    got = terms(f"{gqa} --recompute-granularity selective")
    assert got["q, k, v"] == 8 * PER_HEAD * 4 and got["q (copied from the groups)"] == 4 * PER_HEAD * 4
    assert "k, v per query head" not in got


def test_fp32_rmsnorm_keeps_its_input():
    got = [(t.name, t.nbytes) for t in memory.layer_terms(*reversed(run("--normalization RMSNorm")))
           if t.module == "attn_norm"]
    assert got == [("norm input (fp32)", 32 * 2 * 64 * 4), ("norm rstd", 32 * 2 * 4),
                   ("norm normalized (fp32)", 32 * 2 * 64 * 4)]


def test_aux_loss_adds_its_scores_indices_and_counts_to_routing():
    without = terms(MOE, moe=True)["routing"]
    # top-k indices int64 + probabilities fp32 per routed pair, routing map bool + probabilities fp32 per expert,
    # the permutation's int64 indices
    assert without == 64 * 2 * (8 + 4) + 64 * 4 * (1 + 4) + 64 * 2 * 8
    with_aux = terms(f"{MOE} --moe-aux-loss-coeff 1e-2", moe=True)["routing"]
    # fp32 scores per expert and int64 top-k per token, the tokens per expert (int64) and the loss scalar
    assert with_aux - without == 64 * (4 * 4 + 2 * 8) + 4 * 8 + 4


def test_routed_tokens_balanced_imbalanced_and_capped():
    ep2 = f"{MOE} --expert-model-parallel-size 2"
    args, shape = run(ep2, world=2)
    assert routed_tokens(shape, args) == 64 * 2                   # s x b x topk: 2 experts here, balanced
    per_token = 64 * 4 + (2 + 2 + 1 + 1) * 32 * 4 + 4             # permuted token, SwiGLU's 6 x ffn, its probability
    balanced = terms(ep2, 2, moe=True)
    assert balanced["permuted tokens"] == 128 * 64 * 4
    imbalanced = terms(f"{ep2} --moe-token-imbalance 1.25", 2, moe=True)
    assert sum(imbalanced.values()) - sum(balanced.values()) == 32 * per_token     # 160 tokens
    # never past every token to both local experts: 64 x 2 ranks x min(topk 2, 2 local)
    args, shape = run(f"{ep2} --moe-token-imbalance 3", 2)
    assert routed_tokens(shape, args) == 256
    # capacity factor 1.5: ceil(64 x 2 / 4 x 1.5) = 48 per expert and source rank -> 48 x 2 experts x 2 ranks
    cases = {"--moe-expert-capacity-factor 1.5": 192,
             "--moe-expert-capacity-factor 1.5 --moe-token-imbalance 1.25": 160,
             "--moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity": 192,
             "--moe-expert-capacity-factor 0.5": 64,                                   # 16 x 2 x 2: fewer
             "--moe-expert-capacity-factor 0.5 --moe-pad-expert-input-to-capacity": 64}
    for flags, tokens in cases.items():
        args, shape = run(f"{ep2} {flags}", 2)
        assert routed_tokens(shape, args) == tokens, flags
    # the backward's temporaries follow: fc1's output gradient twice for the routed tokens
    args, shape = run(f"{ep2} --moe-expert-capacity-factor 4 --moe-pad-expert-input-to-capacity "
                      "--moe-ffn-hidden-size 512", 2)
    assert routed_tokens(shape, args) == 64 * 2 * 2
    assert memory.transient(shape, args, 0, 0) == 2 * 256 * 512 * 2 * 4 + 2 * 64 * 64 * 4


def test_report_says_the_routing_assumption_and_its_sensitivity():
    # s = 512 so that +10 % is a visible MiB: 512 x 2 x 2 = 2048 tokens balanced, ceil(2252.8) = 2253 at +10 %
    model = [*MODEL, "--seq-length", "512", "--max-position-embeddings", "512"]
    args, shape = run(f"{MOE} --moe-ffn-hidden-size 64 --expert-model-parallel-size 2", 2, model)
    note, = moe_routing(memory.predict(args), args)
    per_token = 64 * 4 + 6 * 64 * 4 + 4
    added = (2253 - 2048) * per_token * 4 / 2**20                    # 4 MoE layers, one micro-batch in flight
    assert "balanced routing assumed" in note and "2048 tokens" in note
    assert f"adds {added:.1f} MiB" in note and added > 1
    args, shape = run(f"{MOE} --expert-model-parallel-size 2 --moe-expert-capacity-factor 1.5 "
                      "--moe-pad-expert-input-to-capacity", 2)
    note, = moe_routing(memory.predict(args), args)
    assert "48 per expert" in note and "192 tokens" in note and "padded" in note
    args, shape = run("", 1)
    assert moe_routing(memory.predict(args), args) == []


@pytest.mark.parametrize("value, says", [("0.9", "must be a number >= 1"), ("nan", "must be a number >= 1"),
                                         ("inf", "must be a number >= 1")])
def test_token_imbalance_is_checked(capsys, value, says):
    with pytest.raises(SystemExit) as exit_:
        run(f"{MOE} --moe-token-imbalance {value}")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--moe-token-imbalance" in err and says in err


def test_token_imbalance_needs_experts(capsys):
    with pytest.raises(SystemExit):
        run("--moe-token-imbalance 1.5")
    assert "--moe-token-imbalance: only for an MoE model (--num-experts)" in capsys.readouterr().err
    assert math.isclose(run(f"{MOE} --moe-token-imbalance 1.5")[0].moe_token_imbalance, 1.5)
