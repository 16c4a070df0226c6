"""--moe-dispatcher-engine hyper through megatron.training (examples/pretrain_gpt.py on forked ranks, CPU processes).

A GPT-MoE as a user would write it — 8 experts, top-2, a shared expert, RMSNorm, SwiGLU, aux-loss router,
megatron's all-to-all dispatcher, ``--moe-grouped-gemm`` (level 1's grouped GEMM) — at expert parallel 2
on 2 ranks with hyper_adaptor's token-dispatch engine, against the same command line with megatron's own
dispatcher: the engine with megatron's ``--moe-shared-expert-overlap`` and MindSpeed's
``--moe-alltoall-overlap-comm`` (the engine's chunked overlap, 2 chunks) under ``--deterministic-mode`` (twice:
bitwise equal); under megatron's selective recompute of the MoE layer and hyper_adaptor's activation swap
with 2 chunks; with hot-expert replicas (``--moe-hot-expert-replicas 2 --moe-replica-interval 2``, rank 0's
per-rank load line at each plan); at EP 2 x CP 2 (4 ranks) against the same 2-rank megatron run (same global
batch); at EP 2 x PP 2 under hyper_adaptor's zero-bubble ``zbh1`` against megatron's own dispatcher and 1F1B,
and under ``zbv`` (V placement, two chunks per rank) against megatron's dispatcher under ``zbv``.
In bf16: megatron's combined 1F1B (``--overlap-moe-expert-parallel-comm``) with megatron's dispatcher (the
losses of its plain schedule) and with the engine's; hyper_adaptor's interleaved schedule pairing micro-batches
through the engine's hooks against the same schedule unpaired.

Tolerances: losses 1e-5 relative (fp32; megatron logs 7 significant digits); grad norms 1e-5 relative
(logged with 4 significant digits, so equal as printed).
"""

import pytest

from tests.e2e.test_pretrain_gpt import MODEL, grad_norms, pretrain

pytestmark = pytest.mark.e2e

MOE_MODEL = [*MODEL, "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
             "--position-embedding-type", "rope", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
             "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
             "--moe-shared-expert-intermediate-size", "64", "--moe-aux-loss-coeff", "1e-2",
             "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--expert-model-parallel-size", "2"]
COMMON = ["--mock-data", "--num-workers", "0", "--train-iters", "4"]
ENGINE = ["--moe-dispatcher-engine", "hyper"]
APPLIED = "expert_parallel (level 2) applied"


def _close(a: float, b: float, rtol: float = 1e-5) -> bool:
    return abs(a - b) <= rtol * abs(b)


@pytest.fixture(scope="module")
def megatron_ep2():
    losses, output = pretrain(2, *COMMON, model=MOE_MODEL)
    assert APPLIED not in output
    return losses, grad_norms(output)


def _matches(want, losses, output):
    want_losses, want_norms = want
    assert APPLIED in output, output[-3000:]
    assert sorted(losses) == sorted(want_losses) == [1, 2, 3, 4]
    norms = grad_norms(output)
    assert all(_close(losses[i], want_losses[i]) for i in want_losses), (losses, want_losses)
    assert all(_close(norms[i], want_norms[i]) for i in want_norms), (norms, want_norms)


# Several engine features per torchrun run (each run costs a megatron start-up on 2 cores): the first two
# combinations together serve every engine flag, each against megatron's dispatcher.
COMBINED = {
    # MindSpeed's flag asks for the engine's chunked overlap (2 chunks); the shared expert under the dispatch;
    # run twice under --deterministic-mode: the two runs equal each other bitwise
    "shared-overlap-mindspeed-deterministic": ["--moe-shared-expert-overlap", "--moe-alltoall-overlap-comm",
                                               "--deterministic-mode"],
    # megatron's selective recompute of the MoE layer and hyper_adaptor's activation swap, over 2 chunks
    "recompute-moe-swap-chunks2": ["--recompute-granularity", "selective", "--recompute-modules", "moe",
                                   "--swap-attention", "--moe-dispatch-chunks", "2"],
}


@pytest.mark.parametrize("name", list(COMBINED))
def test_ep2_engine_matches_megatrons_dispatcher(megatron_ep2, name):
    extra = COMBINED[name]
    losses, output = pretrain(2, *COMMON, *ENGINE, *extra, model=MOE_MODEL)
    assert ("swap (level 2) applied" in output) == ("--swap-attention" in extra)
    _matches(megatron_ep2, losses, output)
    if "--deterministic-mode" in extra:
        again, again_output = pretrain(2, *COMMON, *ENGINE, *extra, model=MOE_MODEL)
        assert again == losses and grad_norms(again_output) == grad_norms(output)


def test_ep2_engine_with_hot_expert_replicas_matches_megatrons_dispatcher(megatron_ep2):
    """Replicas planned every 2 iterations (so iterations 3 and 4 run with them): the same losses and grad
    norms as megatron's own dispatcher without replicas, and rank 0 logs the per-rank load at each plan."""
    losses, output = pretrain(2, *COMMON, *ENGINE, "--moe-hot-expert-replicas", "2", "--moe-replica-interval", "2",
                              model=MOE_MODEL)
    _matches(megatron_ep2, losses, output)
    # tighter than 1e-5: a replica gradient that never reaches its owner moves iteration 4's loss by about
    # 1e-5 relative here (the loads are nearly even, so the replicas take few tokens); with the reduction
    # the losses agree to the last digit megatron prints
    want = megatron_ep2[0]
    assert all(_close(losses[i], want[i], 5e-7) for i in want), (losses, want)
    lines = [line for line in output.splitlines() if line.startswith("hot-expert replicas (MoE layer")]
    # one line per MoE layer (4) per plan (iterations 2 and 4), from rank 0 only
    assert len(lines) == 8, output[-3000:]
    assert sorted(int(line.split("MoE layer ")[1].split(")")[0]) for line in lines) == [1, 1, 2, 2, 3, 3, 4, 4]
    assert all("before [" in line and "after [" in line and "max/mean" in line for line in lines), lines
    # the plans of iteration 4 were measured over iterations 3 and 4, served by the replicas of iteration 2
    assert any("replicas: expert" in line for line in lines[:4]), lines


PP2 = ["--pipeline-model-parallel-size", "2"]
CP2 = ["--context-parallel-size", "2", "--context-parallel-algo", "megatron_cp_algo"]


def test_ep2_cp2_engine_matches_the_two_rank_megatron_run(megatron_ep2):
    losses, output = pretrain(4, *COMMON, *ENGINE, *CP2, model=MOE_MODEL, timeout=600)
    _matches(megatron_ep2, losses, output)


@pytest.fixture(scope="module")
def megatron_ep2_pp2():
    """megatron's own dispatcher and 1F1B at EP 2 x PP 2: a pipeline stage initialises its layers from its
    own start of the random stream, so PP 2 starts from other weights than PP 1."""
    losses, output = pretrain(4, *COMMON, *PP2, model=MOE_MODEL, timeout=600)
    assert APPLIED not in output
    return losses, grad_norms(output)


def test_ep2_pp2_engine_under_zbh1_matches_megatrons_dispatcher_under_1f1b(megatron_ep2_pp2):
    """The engine in hyper_adaptor's zero-bubble schedule (split weight gradients) against megatron's own
    dispatcher and 1F1B at the same layout (the engine under megatron's 1F1B is the distributed tests')."""
    losses, output = pretrain(4, *COMMON, *ENGINE, *PP2, "--pipeline-schedule", "zbh1", model=MOE_MODEL, timeout=600)
    assert "pipeline (level 2) applied" in output
    _matches(megatron_ep2_pp2, losses, output)


def test_ep2_pp2_engine_under_zbv_matches_megatrons_dispatcher_under_zbv():
    """ZBV's V placement (two model chunks per rank, untied output layer) with the engine against megatron's
    dispatcher under the same schedule (the V puts layers on other ranks than 1F1B, so it is its own
    reference)."""
    flags = [*COMMON, *PP2, "--num-virtual-stages-per-pipeline-rank", "2", "--untie-embeddings-and-output-weights",
             "--pipeline-schedule", "zbv"]
    want, want_output = pretrain(4, *flags, model=MOE_MODEL, timeout=600)
    assert APPLIED not in want_output
    losses, output = pretrain(4, *flags, *ENGINE, model=MOE_MODEL, timeout=600)
    _matches((want, grad_norms(want_output)), losses, output)


@pytest.fixture(scope="module")
def megatron_ep2_bf16():
    losses, output = pretrain(2, *COMMON, "--bf16", model=MOE_MODEL)
    assert APPLIED not in output
    assert sorted(losses) == [1, 2, 3, 4]
    return losses, grad_norms(output)


# megatron's combined 1F1B (bf16 or fp16 only): it asks the script's forward_step for the model's schedule
# plan and runs one micro-batch's forward nodes between another's backward nodes
COMBINED_1F1B = ["--bf16", "--overlap-moe-expert-parallel-comm"]


def test_ep2_megatrons_combined_1f1b_gives_the_losses_of_its_plain_schedule(megatron_ep2_bf16):
    losses, output = pretrain(2, *COMMON, *COMBINED_1F1B, model=MOE_MODEL)
    assert APPLIED not in output
    assert (losses, grad_norms(output)) == megatron_ep2_bf16


def test_ep2_engine_in_megatrons_combined_1f1b_follows_megatrons_dispatcher_in_bf16(megatron_ep2_bf16):
    """The engine's dispatch and combine as megatron's dispatch and combine nodes, in bf16. The engine weights
    the expert outputs after the second projection (megatron: the activation before it), so a bf16 rounding
    lands elsewhere: within bf16's precision of megatron's dispatcher (whose losses the combined schedule
    leaves as they are, above)."""
    losses, output = pretrain(2, *COMMON, *COMBINED_1F1B, *ENGINE, model=MOE_MODEL)
    assert APPLIED in output
    want = megatron_ep2_bf16[0]
    assert sorted(losses) == sorted(want) == [1, 2, 3, 4]
    assert all(_close(losses[i], want[i], 2e-3) for i in want), (losses, want)


def test_ep2_pp2_interleaved_pairs_forward_and_backward_through_the_engines_hooks():
    """hyper_adaptor's interleaved schedule with --overlap-moe-expert-parallel-comm: each steady (F, B) pair's
    forward and backward run on two threads meeting at the hooks around the engine's dispatch and combine
    (EP 2 x PP 2, two model chunks per rank, 4 ranks): the losses and grad norms of the same schedule run one
    step after the other."""
    flags = ["--mock-data", "--num-workers", "0", "--train-iters", "2", "--bf16", *ENGINE, *PP2,
             "--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "interleaved"]
    want, want_output = pretrain(4, *flags, model=MOE_MODEL, timeout=600)
    losses, output = pretrain(4, *flags, "--overlap-moe-expert-parallel-comm", model=MOE_MODEL, timeout=600)
    assert "pipeline (level 2) applied" in output and APPLIED in output
    assert sorted(losses) == [1, 2]
    assert (losses, grad_norms(output)) == (want, grad_norms(want_output))
