"""A world made with backend="nccl" (code written for CUDA) runs on CPU, gloo."""

import pytest

from hyper_adaptor import platform
from hyper_adaptor.testing import WorldError, run_world

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(platform.device_type() != "cpu", reason="the nccl -> gloo mapping is the CPU platform's"),
]
CHECKS = "tests.distributed.nccl_request_checks"


def test_nccl_world_runs_megatron_tp2_on_gloo():
    results = run_world(2, f"{CHECKS}:tp2_from_nccl_request", timeout=180)
    for result in results:
        assert result["backend"] == result["tp_backend"] == result["explicit_backend"] == "gloo"
        assert result["tp_size"] == 2
        assert result["sum"] == (1 + 2) * 2  # TP all-reduce, then the same sum over the explicit group


def test_without_the_mapping_the_nccl_request_fails():
    with pytest.raises(WorldError, match="(?i)nccl"):
        run_world(2, f"{CHECKS}:tp2_from_nccl_request", timeout=180, unpatched=True)


def test_megatron_group_created_with_nccl_uses_gloo():
    results = run_world(2, f"{CHECKS}:megatron_pp_backend_nccl", timeout=180)
    assert [r["pp_backend"] for r in results] == ["gloo", "gloo"]
    assert [r["sum"] for r in results] == [2.0, 2.0]
