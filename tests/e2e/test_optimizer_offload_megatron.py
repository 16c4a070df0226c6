"""--optimizer-cpu-offload through megatron.training (examples/pretrain_gpt.py on forked ranks, 2 CPU processes):
losses and gradient norms as logged (7 and 4 significant digits) equal to the same command without the
flag, 3 iterations, with megatron's own spelling (``--use-precision-aware-optimizer`` along, which
megatron's validate_args asserts) and the distributed optimizer: in fp32 hyper_adaptor switches the
precision-aware flag off with a notice; with ``--bf16`` it keeps it, and megatron's own precision-aware
path runs (no fp32 main shards; its CPU-offload optimizer class replaced by hyper_adaptor's); with ``--bf16``
alone megatron's bf16 optimizer runs with its fp32 main copies released (the engine's host masters in their
place), with ``--log-params-norm`` logging the same norms as without the flag. (HSDP, bf16, TP2 with half
the state offloaded and PP2 are checked in tests/distributed/test_optimizer_offload_megatron.py; --use-hsdp
through torchrun in tests/e2e/test_memory_megatron.py — one torchrun pair costs ~1.5 min of the suite.)"""

import re

import pytest

from tests.e2e.test_pretrain_gpt import MODEL, grad_norms, pretrain

pytestmark = pytest.mark.e2e
COMMON = ["--mock-data", "--train-iters", "3", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
          "--num-workers", "0"]
LAYOUTS = {
    # (flags of both runs, offload flags, the notice the offload run logs)
    "distopt": (["--use-distributed-optimizer"], ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"],
                "--optimizer-cpu-offload: megatron's DistributedOptimizer steps through hyper_adaptor's "
                "OffloadOptimizer (100%"),
    # bf16: megatron's precision-aware path kept (no fp32 main shards beside the bf16 parameters), its
    # CPU-offload optimizer class replaced by hyper_adaptor's
    "bf16-distopt-precision-aware": (
        ["--use-distributed-optimizer", "--bf16"], ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"],
        "--optimizer-cpu-offload --use-precision-aware-optimizer: megatron's DistributedOptimizer steps through "
        "hyper_adaptor's OffloadOptimizer (100% of rank 0's elements with state and fp32 masters on the host; no fp32 "
        "main copies beside the parameters)"),
    # megatron's bf16 optimizer (Float16OptimizerWithFloat16Params): its fp32 main copies released, the
    # engine's host masters in their place (--log-params-norm reads them: the same norm as without)
    "bf16": (["--bf16", "--log-params-norm"], ["--optimizer-cpu-offload"],
             "--optimizer-cpu-offload: megatron's Float16OptimizerWithFloat16Params steps through hyper_adaptor's "
             "OffloadOptimizer (100% of rank 0's elements with state on the host; the fp32 main copies of "),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_offload_matches_megatrons_optimizer_through_pretrain_gpt(name):
    flags, offload_flags, served = LAYOUTS[name]
    reference, reference_output = pretrain(2, *COMMON, *flags, model=MODEL)
    offload, output = pretrain(2, *COMMON, *flags, *offload_flags, model=MODEL)
    assert sorted(offload) == [1, 2, 3]
    assert offload == reference
    assert grad_norms(output) == grad_norms(reference_output)
    assert params_norms(output) == params_norms(reference_output)
    assert len(params_norms(output)) == (3 if "--log-params-norm" in flags else 0)
    assert "optimizer_offload (level 2) applied" in output
    # megatron's wrapper for the layout built, its optimizer swapped for (or served by) the engine
    assert served in output
    assert "OffloadOptimizer" not in reference_output
    switched = "--use-precision-aware-optimizer: True -> False" in output
    assert switched == ("--bf16" not in flags)  # kept where megatron's own precision-aware path takes it


def params_norms(output: str) -> list[str]:
    return re.findall(r"params norm: *([0-9.eE+-]+)", output)
