"""--pipeline-schedule through megatron.training (examples/pretrain_gpt.py on forked ranks, 4 CPU processes,
PP2 x DP2, two model chunks per rank, untied output layer, dropout off):

- ZBV trains and saves; its checkpoint (megatron's layer numbering, torch_dist) resumes under megatron's own
  1F1B without model chunks, with the same next loss as the uninterrupted ZBV run;
- interleaved 1F1B with model chunks under --use-hsdp (HSDP's refusal of virtual pipeline stages lifted)
  gives megatron's own interleaved run's losses and grad norms (1e-5 relative: HSDP reduces gradients
  otherwise than megatron's DDP; the schedules alone are equal to megatron's, bitwise in practice:
  tests/distributed/test_pipeline_megatron.py). ZBV is not compared with them here: megatron draws a
  layer's initial weights from its pipeline rank's RNG, and the V puts layers on other ranks.
"""

import pytest

from tests.e2e.test_pretrain_gpt import grad_norms, pretrain

pytestmark = pytest.mark.e2e

COMMON = ["--mock-data", "--num-workers", "0", "--train-iters", "4", "--pipeline-model-parallel-size", "2",
          "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0"]
CHUNKS = ["--num-virtual-stages-per-pipeline-rank", "2"]


def _close(a: float, b: float, rtol: float = 1e-5) -> bool:
    return abs(a - b) <= rtol * abs(b)


@pytest.fixture(scope="module")
def zbv_run(tmp_path_factory):
    """ZBV at PP2 x DP2, saved at iteration 2 of 4: read by both tests. Returns (checkpoint, losses, output)."""
    ckpt = tmp_path_factory.mktemp("zbv") / "ckpt"
    zbv, output = pretrain(4, *COMMON, *CHUNKS, "--pipeline-schedule", "zbv", "--save", str(ckpt),
                           "--save-interval", "2")
    return ckpt, zbv, output


def test_zbv_trains_and_resumes_under_megatrons_1f1b_and_hsdp_runs_model_chunks(zbv_run):
    ckpt, zbv, output = zbv_run
    assert "pipeline (level 2) applied" in output, output[-3000:]
    assert sorted(zbv) == [1, 2, 3, 4] and zbv[4] < zbv[1], zbv

    resumed, output = pretrain(4, *COMMON, "--load", str(ckpt), "--ckpt-step", "2")
    assert "pipeline (level 2) applied" not in output  # megatron's own schedule, one chunk per rank
    assert sorted(resumed) == [3, 4] and _close(resumed[3], zbv[3]), (resumed, zbv)

    megatron, output = pretrain(4, *COMMON, *CHUNKS)  # megatron's interleaved schedule, megatron's DDP
    want_norms = grad_norms(output)
    hsdp, output = pretrain(4, *COMMON, *CHUNKS, "--pipeline-schedule", "interleaved", "--use-hsdp")
    assert "hsdp (level 2) applied" in output and "pipeline (level 2) applied" in output
    norms = grad_norms(output)
    assert sorted(hsdp) == sorted(megatron) == [1, 2, 3, 4]
    assert all(_close(hsdp[i], megatron[i]) for i in megatron), (hsdp, megatron)
    assert all(_close(norms[i], want_norms[i]) for i in want_norms), (norms, want_norms)


MEGATRON_LM_SCRIPT = "tests/e2e/megatron_lm_pretrain_gpt.py"


def test_zbv_trains_megatron_lms_own_batch_helpers_like_1f1b(zbv_run):
    """Megatron-LM's pretrain_gpt.py hands megatron's TP batch helper the pipeline rank's first / last
    answers; the V puts the loss stage on rank 0, the first rank, whose batch would then hold no labels or
    loss mask (its loss_func dies on ``loss_mask.view``). ZBV and 1F1B both resume the ZBV run's
    checkpoint of iteration 2 at PP 2 (so they start from the same weights: megatron seeds a layer's
    initial weights by its pipeline rank, and the V moves layers to other ranks; a resumed run's losses
    are compared with a resumed run's) and must give the same losses (1e-5 relative: the same
    micro-batch computations, gradients accumulated in another order)."""
    resumed = ["--load", str(zbv_run[0]), "--ckpt-step", "2"]
    one_f_one_b, output = pretrain(2, *COMMON, *resumed, "--pipeline-schedule", "1f1b", script=MEGATRON_LM_SCRIPT,
                                   timeout=300)
    assert sorted(one_f_one_b) == [3, 4], output[-3000:]
    zbv, output = pretrain(2, *COMMON, *resumed, *CHUNKS, "--pipeline-schedule", "zbv", script=MEGATRON_LM_SCRIPT,
                           timeout=300)
    assert "pipeline (level 2) applied" in output, output[-3000:]
    assert sorted(zbv) == [3, 4], output[-3000:]
    assert all(_close(zbv[i], one_f_one_b[i]) for i in zbv), (zbv, one_f_one_b)
