"""--optimizer-cpu-offload through megatron.training (examples/pretrain_gpt.py, torchrun, 2 CPU processes):
losses and gradient norms as logged (7 and 4 significant digits) equal to the same command without the
flag, 3 iterations, with megatron's own spelling (``--use-precision-aware-optimizer`` along, which
megatron's validate_args asserts and hyper_adaptor switches off with a notice) and the distributed
optimizer. (HSDP, bf16, TP2 with half the state offloaded and PP2 are checked in
tests/distributed/test_optimizer_offload_megatron.py; --use-hsdp through torchrun in
tests/e2e/test_memory_megatron.py — one torchrun pair costs ~1.5 min of the suite.)"""

import pytest

from tests.e2e.test_pretrain_gpt import MODEL, grad_norms, pretrain

pytestmark = pytest.mark.e2e
COMMON = ["--mock-data", "--train-iters", "3", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
          "--num-workers", "0"]
LAYOUTS = {
    # (flags of both runs, offload flags, wrapper megatron builds, share offloaded)
    "distopt": (["--use-distributed-optimizer"], ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"],
                "DistributedOptimizer", "100%"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_offload_matches_megatrons_optimizer_through_pretrain_gpt(name):
    flags, offload_flags, wrapper, share = LAYOUTS[name]
    reference, reference_output = pretrain(2, *COMMON, *flags, model=MODEL)
    offload, output = pretrain(2, *COMMON, *flags, *offload_flags, model=MODEL)
    assert sorted(offload) == [1, 2, 3]
    assert offload == reference
    assert grad_norms(output) == grad_norms(reference_output)
    assert "memory (level 2) applied" in output
    # megatron's wrapper for the layout built, its torch optimizer swapped for the engine
    assert f"--optimizer-cpu-offload: megatron's {wrapper} steps through hyper_adaptor's OffloadOptimizer ({share}" \
        in output
    assert "OffloadOptimizer" not in reference_output
    if "--use-precision-aware-optimizer" in offload_flags:
        assert "--use-precision-aware-optimizer: True -> False" in output
