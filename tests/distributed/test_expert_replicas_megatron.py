"""Hot-expert replicas in megatron's ``MoELayer`` (``--moe-dispatcher-engine hyper --moe-hot-expert-replicas``):
training with replicas equals training without them.

One spawned world of 4 gloo ranks (rank code in tests/distributed/expert_replicas_megatron_checks.py)
trains megatron's MoE layer (8 experts, top-2, SwiGLU, aux-loss router) on a router skewed towards
experts 0 and 1 for 5 SGD steps, replanning every step, at EP 4 (also with a shared expert and
megatron's ``--moe-shared-expert-overlap``) and, replanning every 2 steps, at EP 2 x expert-data-parallel
2: with 3 replicas the per-step losses, the router's and every expert's weights equal the run without
replicas within 1e-6 (fp32, absolute plus relative). The replicas really served tokens (a plan with
replicas, the load after below the load before), and a run whose replica gradients never reach their
owners differs far above the tolerance, so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch

from hyper_adaptor.testing import run_world

pytestmark = pytest.mark.distributed

TOL = 1e-6
WRONG = 1e-4
SHARED = dict(moe_shared_expert_intermediate_size=12, moe_shared_expert_overlap=True)
RUNS = {
    "ep4-off": dict(ep=4, replicas=0, interval=1),
    "ep4-on": dict(ep=4, replicas=3, interval=1),
    "ep4-on-no-grad-reduce": dict(ep=4, replicas=3, interval=1, reduce=False),
    "ep2-dp2-off": dict(ep=2, replicas=0, interval=1),
    "ep2-dp2-on": dict(ep=2, replicas=3, interval=2),
    # megatron's shared expert overlapped with the dispatch without replicas; with them, between the steps
    "ep4-shared-overlap-off": dict(ep=4, replicas=0, interval=1, extra=SHARED),
    "ep4-shared-overlap-on": dict(ep=4, replicas=3, interval=1, extra=SHARED),
}
PAIRS = {"ep4-on": "ep4-off", "ep2-dp2-on": "ep2-dp2-off", "ep4-shared-overlap-on": "ep4-shared-overlap-off"}


@pytest.fixture(scope="module")
def world():
    results = run_world(4, "tests.distributed.expert_replicas_megatron_checks:replica_runs", timeout=300,
                        runs=RUNS)
    for rank, result in enumerate(results):
        for name, got in result.items():
            assert not isinstance(got, str), f"rank {rank} {name}: {got[-3000:]}"
    return results


def _excess(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far ``a`` is from ``b`` in units of the tolerance (1e-6 absolute plus 1e-6 relative): <= 1 is equal."""
    return ((a - b).abs() / (TOL + TOL * b.abs())).max().item()


def _difference(ours: dict, theirs: dict) -> float:
    worst = max(_excess(ours["losses"], theirs["losses"]), _excess(ours["router"], theirs["router"]))
    assert ours["experts"].keys() == theirs["experts"].keys()
    for expert, params in ours["experts"].items():
        for a, b in zip(params, theirs["experts"][expert]):
            worst = max(worst, _excess(a, b))
    return worst


@pytest.mark.parametrize("on, off", list(PAIRS.items()))
def test_replicas_train_as_without(world, on, off):
    for rank, results in enumerate(world):
        assert _difference(results[on], results[off]) <= 1, (rank, on)
        assert results[on]["replicas_in_plan"] == [3], (rank, results[on]["replicas_in_plan"])
        assert results[off]["replicas_in_plan"] == [], (rank, off)


def test_the_load_is_logged_and_drops_with_replicas(world):
    lines = world[0]["ep4-on"]["lines"]
    assert len(lines) == 5 and all(line.startswith("hot-expert replicas (MoE layer 1)") for line in lines), lines
    reports = [_loads(line) for line in lines]
    # the first window ran without replicas; from the second on the replicas took load off rank 0
    before, after = reports[1]
    assert before[0] == max(before) and after[0] < before[0] and max(after) < max(before), lines[1]


def _loads(line: str):
    import re

    found = re.search(r"before \[([^\]]*)\].*after \[([^\]]*)\]", line)
    return [[int(v) for v in found.group(k).split(",")] for k in (1, 2)]


def test_a_missing_replica_gradient_reduction_shows(world):
    worst = max(_difference(results["ep4-on-no-grad-reduce"], results["ep4-off"]) for results in world)
    assert worst > WRONG / TOL, worst


def test_the_router_is_skewed(world):
    # the load line of the first window: rank 0 (experts 0 and 1) takes most tokens
    before, _ = _loads(world[0]["ep4-on"]["lines"][0])
    assert before[0] > 0.5 * sum(before), before
    assert torch.is_tensor(world[0]["ep4-off"]["losses"])
