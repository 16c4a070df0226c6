"""Sharded Muon over HSDP shards (4 gloo ranks) against one process: tests/distributed/muon_checks.py.

Tolerance (fp32): losses 1e-6 relative, every parameter after 3 steps 2e-6 absolute; Newton-Schulz runs
per rank exactly the balanced owner assignment's.
"""

import pytest

from hyper_adaptor.testing import run_world

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results():
    return run_world(4, "tests.distributed.muon_checks:sharded_matrix", timeout=300)[0]


@pytest.mark.parametrize("case", ["level1-S2", "level1-S4", "level3-S2", "level3-S4"])
def test_matches_one_process_and_runs_each_matrix_once_per_shard_group(results, case):
    assert results[case] == []
