"""The memory flags through megatron.training (examples/pretrain_gpt.py on forked ranks, 2 CPU processes, DP2):
MindSpeed's --swap-attention, --recompute-activation-function and --recompute-norm, and megatron's own
--cpu-offloading-num-layers and --fine-grained-activation-offloading (TE-only in megatron), against the
same command without them; the swap run's checkpoint resumed without any memory flag; megatron's offload
flags and --optimizer-cpu-offload under --use-hsdp; the recompute flags under --use-hsdp level 3.

Swap recomputes nothing, and the two recomputes re-run the forward ops with the RNG restored, so the
logged losses and grad norms are equal as printed (megatron logs 7 / 4 significant digits). Under
--use-hsdp (a different gradient reduction than megatron's DDP) they agree to 1e-5 relative.
"""

import pytest

from tests.e2e.test_pretrain_gpt import grad_norms, pretrain

pytestmark = pytest.mark.e2e

COMMON = ["--mock-data", "--num-workers", "0", "--train-iters", "4", "--min-offloaded-tensor-size", "0"]


def _close(a: float, b: float, rtol: float = 1e-5) -> bool:
    return abs(a - b) <= rtol * abs(b)


@pytest.fixture(scope="module")
def plain():
    losses, output = pretrain(2, *COMMON)
    return losses, grad_norms(output)


def test_swap_and_recompute_flags_equal_the_plain_run_and_resume_without_them(plain, tmp_path):
    want_losses, want_norms = plain
    ckpt = tmp_path / "ckpt"
    losses, output = pretrain(2, *COMMON, "--swap-attention", "--swap-prefetch-layers", "2",
                              "--recompute-activation-function", "--recompute-norm",
                              "--save", str(ckpt), "--save-interval", "2")
    assert "swap (level 2) applied" in output and "recompute (level 2) applied" in output
    assert "--recompute-modules: None -> ['layernorm']" in output
    assert sorted(losses) == sorted(want_losses) == [1, 2, 3, 4]
    assert losses == want_losses and grad_norms(output) == want_norms

    resumed, _ = pretrain(2, *COMMON, "--load", str(ckpt), "--ckpt-step", "2")
    assert sorted(resumed) == [3, 4] and resumed[3] == losses[3], (resumed, losses)


def test_megatron_offload_flags_and_optimizer_offload_are_served_under_hsdp(plain):
    want_losses, want_norms = plain
    losses, output = pretrain(2, *COMMON, "--use-hsdp", "--cpu-offloading-num-layers", "1",
                              "--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj",
                              "--optimizer-cpu-offload")
    assert "--fine-grained-activation-offloading: True -> False" in output and "hsdp (level 2) applied" in output
    assert "steps through hyper_adaptor's OffloadOptimizer" in output
    assert sorted(losses) == sorted(want_losses) == [1, 2, 3, 4]
    norms = grad_norms(output)
    assert all(_close(losses[i], want_losses[i]) for i in want_losses), (losses, want_losses)
    assert all(_close(norms[i], want_norms[i]) for i in want_norms), (norms, want_norms)


def test_recompute_flags_under_hsdp_level3_equal_the_plain_run(plain):
    """HSDP level 3 frees a layer's parameters after its forward; megatron's norm recompute and the
    activation-function recompute re-run forward code inside the layer's backward, reading the module's
    parameters: HSDP registers the gathered ones from the start of the layer's backward to its end."""
    want_losses, want_norms = plain
    losses, output = pretrain(2, *COMMON, "--use-hsdp", "--hsdp-optimizer-level", "level3", "--swap-attention",
                              "--recompute-norm", "--recompute-activation-function")
    assert "hsdp (level 2) applied" in output and "recompute (level 2) applied" in output
    norms = grad_norms(output)
    assert sorted(losses) == sorted(want_losses) == [1, 2, 3, 4]
    assert all(_close(losses[i], want_losses[i]) for i in want_losses), (losses, want_losses)
    assert all(_close(norms[i], want_norms[i]) for i in want_norms), (norms, want_norms)
