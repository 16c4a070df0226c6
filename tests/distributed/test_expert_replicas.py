"""Hot-expert replicas on 4 gloo ranks: training with replicas equals training without them.

One spawned world (rank code in tests/distributed/expert_replica_checks.py) trains a MoE layer with
a Zipf-skewed router for 7 steps, replanning every 2, with SGD (momentum) and with Adam on the owned
expert weights and the router, fp32: with replicas the losses and every weight equal the run without
them within 1e-6, and the rows each rank computes drop from max/mean > 2 to <= 1.1 once the first plan
is in. A replica whose gradient never reaches its owner, or whose weights are not refreshed after the
optimizer step, shows as a mismatch far above the tolerance (the check can fail).
"""

from __future__ import annotations

import importlib.util

import pytest

from hyper_adaptor.parallel.expert._replicas import imbalance
from hyper_adaptor.testing import run_world
from tests.distributed.expert_replica_checks import EXPERTS, INTERVAL, STEPS, TOKENS, TOPK

pytestmark = pytest.mark.distributed

TOL = 1e-6
WRONG = 1e-4        # a wrong reduction moves losses or weights at least this much
OPTIMIZERS = ("sgd", "adam")


def _engine_ready():
    spec = importlib.util.find_spec("hyper_adaptor.parallel.expert._dispatcher")
    return spec is not None


DISPATCHERS = ("primitives", "engine") if _engine_ready() else ("primitives",)


@pytest.fixture(scope="module")
def world():
    return run_world(4, "tests.distributed.expert_replica_checks:replica_checks", timeout=420,
                     dispatchers=DISPATCHERS)


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_replicas_train_as_without(world, dispatcher, optimizer):
    for rank, result in enumerate(world):
        run = result[f"{dispatcher}-{optimizer}-on"]
        assert run["loss"] <= TOL and run["weights"] <= TOL, (rank, run["loss"], run["weights"])
        # the replicas were really in use: an uneven placement after the first plan
        assert run["plans"][0][0] == (2, 2, 2, 2)
        assert all(sum(plan[0]) == EXPERTS + 3 for plan in run["plans"][INTERVAL:])


@pytest.mark.parametrize("mode", ["no-grad-reduce", "stale-weights"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_wrong_replica_wiring_shows(world, optimizer, mode):
    run = world[0][f"primitives-{optimizer}-{mode}"]
    assert max(run["loss"], run["weights"]) > WRONG, run


def test_every_rank_has_the_same_plan(world):
    for key in (k for k in world[0] if k != "block"):
        for members in ([0, 1], [2, 3]) if key.startswith("ep2x2") else ([0, 1, 2, 3],):
            assert all(world[r][key]["plans"] == world[members[0]][key]["plans"] for r in members), key


def test_two_ep_groups_with_expert_data_parallel(world):
    """EP 2 x expert-DP 2: the replicas reduce within their EP group (group ranks, not world ranks),
    into ``main_grad``, before the expert-data-parallel sum."""
    for rank, result in enumerate(world):
        run = result["ep2x2-adam-on"]
        assert run["loss"] <= TOL and run["weights"] <= TOL, (rank, run["loss"], run["weights"])
        assert all(sum(plan[0]) == 4 + 2 for plan in run["plans"][INTERVAL:])
        wrong = result["ep2x2-adam-no-grad-reduce"]
        assert max(wrong["loss"], wrong["weights"]) > WRONG


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_rows_per_rank_balanced_by_the_replicas(world, dispatcher):
    for mode, bound in (("off", None), ("on", 1.1)):
        rows = [[result[f"{dispatcher}-sgd-{mode}"]["rows"][step] for result in world] for step in range(STEPS)]
        assert all(sum(per_rank) == 4 * TOKENS * TOPK for per_rank in rows)
        for step, per_rank in enumerate(rows):
            if bound is None or step < INTERVAL:   # no plan yet: the skew as routed
                assert imbalance(per_rank) > 2.0, (mode, step, per_rank)
            else:
                assert imbalance(per_rank) <= bound, (mode, step, per_rank)
    report = world[0][f"{dispatcher}-sgd-on"]["report"]
    assert report["before_max_over_mean"] > 2.0 and report["after_max_over_mean"] <= 1.1


def test_moe_block_with_attached_replicas(world):
    """The library path: ``MoE`` sharded by ``ExpertParallel``, ``attach_replicas`` on it, Adam on every
    parameter: the same losses and weights as the block without replicas, and the block's own load
    report shows the skew removed."""
    for rank, result in enumerate(world):
        run = result["block"]
        assert run["loss"] <= TOL and run["weights"] <= TOL, (rank, run["loss"], run["weights"])
    report = world[0]["block"]["report"]
    assert report["before_max_over_mean"] > 2.0 and report["after_max_over_mean"] <= 1.1, report
