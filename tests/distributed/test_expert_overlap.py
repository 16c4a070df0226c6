"""Expert-parallel overlap (hyper_adaptor.parallel.expert._overlap) on 2 and 4 gloo ranks.

One spawned world per size runs every check (``tests/distributed/expert_overlap_checks.py``, tolerances
there): the chunked overlapped MoE against the plain path (bitwise at the same chunk count, within 1e-6
across chunk counts) and the plain path against one process; uneven placement; CommComputeOverlap.run
against forward and backward one after the other; the engine's MoE block through
``moe_forward_overlapped`` and through CommComputeOverlap around its dispatcher; and the two ways the
checks are shown able to fail (a wait left out, exchanges issued without the coordinator).
"""

import pytest

from hyper_adaptor.testing import run_world
from tests.distributed.expert_overlap_checks import CHUNKS

pytestmark = pytest.mark.distributed

TAGS = ("routed", "shared")


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def world(request):
    n = request.param
    return n, run_world(n, "tests.distributed.expert_overlap_checks:overlap_checks", timeout=150 * n)


def _passed(results, name):
    for rank, result in enumerate(results):
        assert result["checks"][name] == [], f"rank {rank}: {name}"


@pytest.mark.parametrize("tag", TAGS)
def test_plain_path_matches_single_process(world, tag):
    _passed(world[1], f"plain-vs-single-process/{tag}")


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("chunks", CHUNKS)
def test_overlap_is_bitwise_the_plain_path(world, chunks, tag):
    _passed(world[1], f"overlap-vs-plain/chunks{chunks}/{tag}")
    _passed(world[1], f"launches/chunks{chunks}/{tag}")


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("chunks", [c for c in CHUNKS if c > 1])
def test_chunks_match_one_chunk(world, chunks, tag):
    _passed(world[1], f"chunks-vs-one/chunks{chunks}/{tag}")


def test_uneven_placement(world):
    _passed(world[1], "placement/overlap-vs-single-process")
    _passed(world[1], "placement/refused")


@pytest.mark.parametrize("layers", [1, 2])
def test_comm_compute_overlap_run_matches_sequential(world, layers):
    _passed(world[1], f"comm-compute-overlap/{layers}-layers")


def test_coordinator_orders_the_exchanges(world):
    _, results = world
    _passed(results, "race/coordinated")
    # the same pair without the coordinator: exchanges issued in different orders on different ranks
    assert any(r["race_detected"] for r in results)


def test_a_missing_wait_is_detected(world):
    _, results = world
    assert results[0]["broken_detected"], "reading rank 1's rows before they arrived went unnoticed"


def test_measure_exposed_comm(world):
    _, results = world
    assert all(r["measure_ok"] for r in results)


@pytest.mark.parametrize("variant", ["dropless", "capacity"])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_engine_moe_block(world, variant, chunks):
    # chunks=1 bitwise the block's own forward (AllToAllDispatcher), more chunks within 1e-6
    _passed(world[1], f"engine-moe/{variant}/chunks{chunks}")


def test_engine_moe_refuses_padding(world):
    _passed(world[1], "engine-moe/padding-refused")


def test_comm_compute_overlap_around_the_engine_dispatcher(world):
    _passed(world[1], "engine-moe/comm-compute-overlap")


def test_pipeline_overlap_b_f_pairs_through_comm_compute_overlap(world):
    # 1F1B overlap_b_f, a Linear + MoE stage (EP over the pipeline replicas on 4 ranks): bitwise the
    # sequential pairs, every FWD_BWD pair run through CommComputeOverlap.run, every hook paired
    _passed(world[1], "pipeline/overlap_b_f-pairs")


@pytest.mark.parametrize("case", ["chunks4/overlap", "chunks4/plain", "chunks1/plain"])
def test_exchanges_in_flight(world, case):
    # overlapped: a dispatch and a combine (forward) / two reverse exchanges (backward) at once
    _passed(world[1], f"in-flight/{case}")
