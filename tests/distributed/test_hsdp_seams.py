"""--use-hsdp's megatron-optimizer seams that the e2e runs cannot provoke on purpose (2 gloo ranks)."""

import pytest

from hyper_adaptor.testing import run_world

pytestmark = pytest.mark.distributed


def test_an_overflow_in_one_shard_skips_the_step_on_every_rank():
    results = run_world(2, "tests.distributed.hsdp_seam_checks:found_inf_agreement", timeout=120)
    assert [r["alone"] for r in results] == [True, False]  # megatron's own check disagrees
    assert [r["wrapped"] for r in results] == [True, True]
    assert [r["found_inf"] for r in results] == [1.0, 1.0]
    assert [r["unmanaged"] for r in results] == [True, False]
