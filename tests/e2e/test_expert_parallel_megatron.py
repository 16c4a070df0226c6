"""--moe-dispatcher-engine hyper through megatron.training (examples/pretrain_gpt.py, torchrun, CPU processes).

A GPT-MoE as a user would write it — 8 experts, top-2, a shared expert, RMSNorm, SwiGLU, aux-loss router,
megatron's all-to-all dispatcher, ``--moe-grouped-gemm`` (level 1's grouped GEMM) — at expert parallel 2
on 2 ranks with hyper_adaptor's token-dispatch engine, against the same command line with megatron's own
dispatcher; then the engine with megatron's ``--moe-shared-expert-overlap`` and with MindSpeed's
``--moe-alltoall-overlap-comm`` (the engine's chunked overlap, 2 chunks), under megatron's selective
recompute of the MoE layer and hyper_adaptor's activation swap; in bf16, megatron's combined 1F1B
(``--overlap-moe-expert-parallel-comm``) with megatron's dispatcher and with the engine's; the engine at
EP 2 x CP 2 (4 ranks) against the same 2-rank megatron run (same global batch), and at EP 2 x PP 2 (megatron's 1F1B and
hyper_adaptor's zero-bubble ``zbh1``) against megatron's own dispatcher at EP 2 x PP 2; and the engine with
hot-expert replicas (``--moe-hot-expert-replicas 2 --moe-replica-interval 2``) against megatron's dispatcher
without them, with rank 0's per-rank load line at each plan.

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


@pytest.mark.parametrize("extra", [
    [], ["--moe-shared-expert-overlap"], ["--moe-alltoall-overlap-comm"],
    ["--recompute-granularity", "selective", "--recompute-modules", "moe"],
    ["--swap-attention", "--moe-dispatch-chunks", "2"],
], ids=["engine", "engine-shared-overlap", "mindspeed-alltoall-overlap-comm", "recompute-moe", "swap-chunks2"])
def test_ep2_engine_matches_megatrons_dispatcher(megatron_ep2, extra):
    losses, output = pretrain(2, *COMMON, *ENGINE, *extra, model=MOE_MODEL)
    assert ("swap (level 2) applied" in output) == ("--swap-attention" in extra)
    _matches(megatron_ep2, losses, output)


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


@pytest.mark.parametrize("schedule", [[], ["--pipeline-schedule", "zbh1"]], ids=["1f1b", "zbh1"])
def test_ep2_pp2_engine_matches_megatrons_dispatcher_at_ep2_pp2(megatron_ep2_pp2, schedule):
    losses, output = pretrain(4, *COMMON, *ENGINE, *PP2, *schedule, model=MOE_MODEL, timeout=600)
    assert ("pipeline (level 2) applied" in output) == bool(schedule)
    _matches(megatron_ep2_pp2, losses, output)


@pytest.fixture(scope="module")
def megatron_ep2_bf16():
    losses, output = pretrain(2, *COMMON, "--bf16", model=MOE_MODEL)
    assert APPLIED not in output
    assert sorted(losses) == [1, 2, 3, 4]
    return losses, grad_norms(output)


@pytest.fixture(scope="module")
def engine_ep2_bf16():
    losses, output = pretrain(2, *COMMON, "--bf16", *ENGINE, model=MOE_MODEL)
    assert APPLIED in output
    return losses, grad_norms(output)


def test_ep2_engine_in_bf16_follows_megatrons_dispatcher_in_bf16(megatron_ep2_bf16, engine_ep2_bf16):
    """bf16: the engine weights the expert outputs after the second projection (megatron: the activation
    before it), so a bf16 rounding lands elsewhere; the losses stay within bf16's precision."""
    (want, _), (losses, _) = megatron_ep2_bf16, engine_ep2_bf16
    assert sorted(losses) == sorted(want) == [1, 2, 3, 4]
    assert all(_close(losses[i], want[i], 2e-3) for i in want), (losses, want)


# megatron's combined 1F1B (bf16 or fp16 only): it asks the script's forward_step for the model's schedule
# plan and runs one micro-batch's forward nodes between another's backward nodes
COMBINED_1F1B = ["--bf16", "--overlap-moe-expert-parallel-comm"]


def test_ep2_megatrons_combined_1f1b_gives_the_losses_of_its_plain_schedule(megatron_ep2_bf16):
    losses, output = pretrain(2, *COMMON, *COMBINED_1F1B, model=MOE_MODEL)
    assert APPLIED not in output
    assert (losses, grad_norms(output)) == megatron_ep2_bf16


def test_ep2_engine_in_megatrons_combined_1f1b(megatron_ep2_bf16, engine_ep2_bf16):
    """The engine's dispatch and combine as megatron's dispatch and combine nodes: the same arithmetic as the
    engine's plain run, and megatron's dispatcher (whose losses the combined schedule leaves as they are)
    within bf16's precision."""
    losses, output = pretrain(2, *COMMON, *COMBINED_1F1B, *ENGINE, model=MOE_MODEL)
    assert APPLIED in output
    assert (losses, grad_norms(output)) == engine_ep2_bf16
    want = megatron_ep2_bf16[0]
    assert all(_close(losses[i], want[i], 2e-3) for i in want), (losses, want)


def test_ep2_engine_with_deterministic_mode_repeats_bitwise():
    flags = [*COMMON, "--deterministic-mode", *ENGINE, "--moe-dispatch-chunks", "2", "--moe-shared-expert-overlap"]
    first, first_output = pretrain(2, *flags, model=MOE_MODEL)
    second, second_output = pretrain(2, *flags, model=MOE_MODEL)
    assert APPLIED in first_output
    assert sorted(first) == [1, 2, 3, 4] and first == second
    assert grad_norms(first_output) == grad_norms(second_output)


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
