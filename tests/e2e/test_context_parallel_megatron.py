"""--context-parallel-size through megatron.training (examples/pretrain_gpt.py on forked ranks, CPU processes).

One command line as a user would write it: a GPT with RoPE, SwiGLU, RMSNorm and grouped-query
attention, CP 2 (load-balanced ring) with --use-hsdp level 3 (HSDP's group is data x context), against
the same command at CP 1 in one process (same global batch); then the CP 2 checkpoint resumed at CP 1.

Tolerances: losses 1e-5 relative (megatron logs 7 significant digits); grad norms 1e-5 relative (logged
with 4 significant digits, so equal as printed).
"""

import pytest

from tests.e2e.test_pretrain_gpt import MODEL, grad_norms, pretrain

pytestmark = pytest.mark.e2e

GQA_MODEL = [*MODEL, "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
             "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
             "--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
COMMON = ["--mock-data", "--num-workers", "0", "--train-iters", "4"]


def _close(a: float, b: float, rtol: float = 1e-5) -> bool:
    return abs(a - b) <= rtol * abs(b)


@pytest.fixture(scope="module")
def cp1():
    losses, output = pretrain(1, *COMMON, model=GQA_MODEL)
    return losses, grad_norms(output)


def test_cp2_ring_with_hsdp_level3_matches_cp1_and_resumes_at_cp1(cp1, tmp_path):
    want_losses, want_norms = cp1
    ckpt = tmp_path / "ckpt"
    losses, output = pretrain(
        2, *COMMON, "--context-parallel-size", "2", "--context-parallel-algo", "megatron_cp_algo",
        "--use-hsdp", "--hsdp-optimizer-level", "level3", "--hsdp-threshold-kb", "0",
        "--save", str(ckpt), "--save-interval", "2", model=GQA_MODEL)
    assert "context_parallel (level 2) applied" in output and "hsdp (level 2) applied" in output
    assert sorted(losses) == sorted(want_losses) == [1, 2, 3, 4]
    norms = grad_norms(output)
    assert all(_close(losses[i], want_losses[i]) for i in want_losses), (losses, want_losses)
    assert all(_close(norms[i], want_norms[i]) for i in want_norms), (norms, want_norms)

    # the CP 2 (HSDP, megatron's torch_dist layout) checkpoint of iteration 2, loaded at CP 1 by plain megatron
    resumed, output = pretrain(1, *COMMON, "--load", str(ckpt), "--ckpt-step", "2", model=GQA_MODEL)
    assert sorted(resumed) == [3, 4], resumed
    assert _close(resumed[3], losses[3]), (resumed, losses)
    assert _close(grad_norms(output)[3], norms[3])
