"""The pipeline engine's library API (hyper_adaptor.parallel.pipeline) on 2 and 4 gloo ranks against one process.

One spawned world per size runs every check (tests/distributed/pipeline_engine_checks.py): GPipe, 1F1B,
interleaved 1F1B (2 chunks), ZB-H1 and ZBV on an 8-layer MLP, micro-batches 1..8 (fewer than the ranks, and
not a multiple of them for interleaved), with overlap_p2p / overlap_b_f variants; losses, the merged output
and every parameter gradient against the whole model in one process (sum of the micro-batch losses), fp32
within 1e-6; deferred W (ZB-H1) against immediate B (1F1B); two steps in a row; a forward-only schedule;
hand-broken action lists refused on every rank within seconds, before any communication.
"""

import pytest

from hyper_adaptor.testing import run_world
from tests.distributed.pipeline_engine_checks import CASE_IDS, TOL

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def world(request):
    n = request.param
    return n, run_world(n, "tests.distributed.pipeline_engine_checks:engine_checks", timeout=60 + 30 * n)


@pytest.mark.parametrize("case", CASE_IDS)
def test_schedule_matches_single_process(world, case):
    n, results = world
    for rank, result in enumerate(results):
        r = result["cases"][case]
        assert r["grad_err"] <= TOL, f"rank {rank}: gradient error {r['grad_err']}"
        if r["loss_err"] is not None:  # the rank holding the last stage
            assert r["loss_err"] <= TOL and r["out_err"] <= TOL, f"rank {rank}: {r}"
        else:
            assert r["out_none"], f"rank {rank}: only the last stage's rank returns the output"


def test_split_schedules_defer_weight_gradients_and_others_do_not(world):
    _, results = world
    for result in results:
        for case, r in result["cases"].items():
            assert all(r["routed"]) == case.startswith(("zbh1", "zbv")), case


def test_deferred_w_equals_immediate_b(world):
    _, results = world
    for result in results:
        assert result["deferred_vs_immediate"] <= TOL


def test_live_micro_batches_per_stage(world):
    n, results = world
    for rank, result in enumerate(results):
        assert result["cases"]["gpipe-m8"]["peak_live"] == {rank: 8}
        assert result["cases"]["1f1b-m8"]["peak_live"] == {rank: n - rank}
        assert result["cases"]["1f1b-m2"]["peak_live"] == {rank: min(n - rank, 2)}


def test_two_steps_accumulate(world):
    _, results = world
    for result in results:
        r = result["two_steps"]
        assert r["grad_err"] <= TOL and (r["loss_err"] or 0) <= TOL


def test_forward_only(world):
    _, results = world
    for result in results:
        assert result["forward_only"]["out_err"] <= TOL and result["forward_only"]["grads_none"]


@pytest.mark.parametrize("kind", ["missing_receive", "crossed_order", "deadlock"])
def test_broken_lists_refused_on_every_rank(world, kind):
    n, results = world
    for rank, result in enumerate(results):
        message, seconds = result["broken"][kind]
        assert message != "accepted", f"rank {rank}: {kind} list accepted"
        assert seconds < 5, f"rank {rank}: {seconds:.1f}s to refuse"
    message = results[0]["broken"][kind][0]
    assert "rank 0" in message and "rank 1" in message, message
    assert {"crossed_order": "crossed order", "deadlock": "deadlock", "missing_receive": "missing"}[kind] in message


def test_wrong_number_of_stages_refused(world):
    _, results = world
    for result in results:
        assert "stage" in result["wrong_stage_count"] and result["wrong_stage_count"] != "accepted"
