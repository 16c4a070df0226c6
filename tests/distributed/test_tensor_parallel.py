"""Tensor parallelism as a library (hyper_adaptor.parallel.tensor) on 2 gloo ranks against one process.

fp32, dropout on: losses, every gradient and every parameter after 3 AdamW steps within 1e-5.
"""

import pytest

from hyper_adaptor.testing import run_world

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def world():
    return run_world(2, "tests.distributed.tensor_checks:run", timeout=240)


@pytest.mark.parametrize("variant", ["tp2", "tp2-sp"])
def test_matches_single_process_with_dropout(world, variant):
    for rank in world:
        assert rank["parity"][variant]["bad"] == []
        assert rank["parity"][variant]["all_dtensor"]


def test_dropout_is_really_on(world):
    assert world[0]["parity"]["dropout_matters"]


def test_sharded_dropout_needs_the_full_mask(world):
    for rank in world:
        # the local-shard mask (what the CPU RNG gives by itself) differs; the full-mask slice is exact
        assert rank["dropout"] == {"naive_differs": True, "exact": True}


def test_layout_from_local_distribute_and_init(world):
    for rank in world:
        lay = rank["layout"]
        assert lay["distribute"] and lay["current_mesh"] and lay["from_local"] and lay["partial"]
        assert "tensor dim 0 of size 3 is not divisible by layout axis 'tp' of size 2" in lay["indivisible_error"]
        assert lay["lazy_sharded"] and lay["init_bad"] == []
        assert lay["init_local_shape"] == (16, 16)


def test_parallelize_module_glob_plan_and_errors(world):
    plan = world[0]["plan"]
    assert plan["glob"] == [f"layers.{i}.mlp.{fc}.{w}" for i in range(2) for fc in ("fc1", "fc2")
                            for w in ("bias", "weight")]
    assert "plan key 'layers.*.mlp.fc3' matches no submodule" in plan["bad_key"]
    assert "1-D" in plan["bad_mesh"] and "('a', 'b')" in plan["bad_mesh"]
