"""HSDP shards through megatron's torch_dist checkpoints, 3 gloo ranks (see hsdp_ckpt_checks.py):
saved HSDP rows load back exactly as whole tensors (megatron DDP's layout) and as HSDP rows, and
whole tensors load as HSDP rows. The training-loop save / resume is in tests/e2e/test_hsdp_megatron.py.
"""

import pytest

from hyper_adaptor.testing import run_world

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(3, "tests.distributed.hsdp_ckpt_checks:roundtrips", timeout=240, daemon=False,
                     tmpdir=str(tmp_path_factory.mktemp("hsdp_ckpt")))


def test_the_awkward_splits_happen(results):
    # 10 rows over 3 ranks: 4, 4, 2 (uneven); 2 rows over 3: the last rank holds none; the fc1 [W; V]
    # boundary (row 5) falls inside rank 1's rows 4..8
    assert [r["layout"]["layer0"] for r in results] == [(0, 4, 0), (4, 4, 0), (8, 2, 0)]
    assert [r["layout"]["tiny"] for r in results] == [(0, 1, 0), (1, 1, 0), (2, 0, 0)]
    assert all(r["layout"]["norm"] is None for r in results)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_round_trips_are_exact(results, rank):
    assert results[rank]["problems"] == []
