"""The expert-parallel engine on gloo against one process.

The plain ``MoE`` block (8 experts, top-2, a shared expert, SwiGLU, aux loss; fp32) sharded with
``parallelize_module`` — ``ExpertParallel`` at EP 2 (2 ranks) and EP 4, ``ExpertTensorParallel`` at
EP 2 x ETP 2 on a 2-D ("ep", "tp") mesh, ``ExpertParallel`` on that mesh (ETP 1), with capacity and
padding, an uneven placement, sigmoid routing with GeLU experts, and the block built sharded from
the start (``MoE(..., ep_group=, etp_group=)``) — against the unsharded block run on
every rank's tokens (tests/distributed/expert_engine_checks.py): each rank's output, input gradient and
aux loss, every kept expert weight's gradient (the matching slice of the reference's) and the router's
and shared expert's gradients (summed over the mesh) agree within 1e-5.

And the engine against megatron-core's own ``MoELayer`` with its all-to-all dispatcher at EP 2 and EP 4
(same weights, same tokens per rank): output, input, router and expert gradients within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import expert_engine_checks as checks
from tests.distributed.test_moe_dispatchers import mismatch, world_fixture

pytestmark = pytest.mark.distributed

TARGET = "tests.distributed.expert_engine_checks:layouts"
RTOL = ATOL = 1e-5

WORLD2 = {
    "ep2": dict(ep=2),
    "ep2-capacity-pad": dict(ep=2, variant="capacity-pad"),
    "ep2-capacity-position": dict(ep=2, variant="capacity-position"),
    "ep2-uneven-placement": dict(ep=2, placement=[3, 5]),
    "ep2-sigmoid-gelu": dict(ep=2, variant="sigmoid-gelu"),
    "ep2-vs-megatron-alltoall": dict(ep=2, megatron=True),
    "ep2-built-sharded-uneven-placement": dict(ep=2, built_sharded=True, placement=[3, 5]),
    "ep2-rank-init-broadcast": dict(ep=2, rank_init=True),
}
WORLD4 = {
    "ep4": dict(ep=4),
    "ep4-capacity-pad": dict(ep=4, variant="capacity-pad"),
    "ep2-etp2": dict(ep=2, tp=2, etp=True),
    "ep2-etp2-capacity-pad": dict(ep=2, tp=2, etp=True, variant="capacity-pad"),
    "ep2-etp2-uneven-placement": dict(ep=2, tp=2, etp=True, placement=[5, 3]),
    "ep2-tp2-etp1": dict(ep=2, tp=2),
    "ep4-vs-megatron-alltoall": dict(ep=4, megatron=True),
    "ep2-etp2-built-sharded-capacity-pad": dict(ep=2, tp=2, etp=True, built_sharded=True, variant="capacity-pad"),
    "ep2-etp2-rank-init-broadcast": dict(ep=2, tp=2, etp=True, rank_init=True),
}


world2 = world_fixture(2, TARGET, WORLD2, timeout=240)
world4 = world_fixture(4, TARGET, WORLD4, timeout=360)


_REFERENCES: dict = {}


def reference(world: int, variant: str) -> dict:
    key = (world, variant)
    if key not in _REFERENCES:
        _REFERENCES[key] = checks.reference(world, variant)
    return _REFERENCES[key]


def compare(got: dict, want: dict, rank: int) -> list[str]:
    """Where one rank's result differs from the single process's."""
    bad = []

    def check(what, value, expected):
        bad.extend(mismatch(what, value, expected, rtol=RTOL, atol=ATOL))

    check("output", got["out"], want["out"][rank])
    check("input gradient", got["x_grad"], want["x_grad"][rank])
    check("aux loss", got["aux"], want["aux"][rank])
    if set(got["grads"]) != set(want["grads"]):
        bad.append(f"gradients for {sorted(got['grads'])}, expected {sorted(want['grads'])}")
    first, count, width, shard = got["first"], got["count"], got["width"], got["shard"]
    for name, grad in got["grads"].items():
        expected = want["grads"].get(name)
        if expected is None:
            continue
        if name.startswith("experts."):
            dim = 2 if name.endswith("w_down") else 1
            expected = expected[first:first + count].narrow(dim, shard * width, width)
        check(f"{name} gradient", grad, expected)
    return bad


def _check_world(results: list, runs: dict, world: int, name: str) -> None:
    layout = runs[name]
    want = reference(world, layout.get("variant", "base"))
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert not isinstance(got, str), f"rank {rank}: {got[-1500:]}"
        assert compare(got, want, rank) == [], (rank, name, compare(got, want, rank))


def _engine(runs: dict) -> list:
    return [name for name, layout in runs.items() if not layout.get("megatron")]


@pytest.mark.parametrize("name", _engine(WORLD2))
def test_two_ranks_match_one_process(world2, name):
    _check_world(world2, WORLD2, 2, name)


@pytest.mark.parametrize("name", _engine(WORLD4))
def test_four_ranks_match_one_process(world4, name):
    _check_world(world4, WORLD4, 4, name)


def against_megatron(results: list, name: str) -> list[str]:
    bad = []
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        if isinstance(got, str):
            return [f"rank {rank}: {got[-1500:]}"]
        for what, (engine, megatron) in got.items():
            if engine.shape != megatron.shape or not torch.allclose(engine, megatron, rtol=RTOL, atol=ATOL):
                bad.append(f"rank {rank} {what}: engine {tuple(engine.shape)} vs megatron {tuple(megatron.shape)}, "
                           f"max abs difference {(engine - megatron).abs().max().item():.3g}")
    return bad


def test_engine_matches_megatrons_alltoall_dispatcher(world2, world4):
    assert against_megatron(world2, "ep2-vs-megatron-alltoall") == []
    assert against_megatron(world4, "ep4-vs-megatron-alltoall") == []


def test_each_rank_keeps_only_its_experts_and_its_shard(world2, world4):
    """What the styles leave on each rank: its experts (even or as placed) and, under ETP, half the ffn."""
    for rank, per_rank in enumerate(world2):
        assert (per_rank["ep2"]["first"], per_rank["ep2"]["count"]) == [(0, 4), (4, 4)][rank]
        assert (per_rank["ep2-uneven-placement"]["first"], per_rank["ep2-uneven-placement"]["count"]) == [
            (0, 3), (3, 5)][rank]
        assert per_rank["ep2"]["shapes"]["experts.w_gate"] == (4, checks.FFN, checks.HIDDEN)
    for rank, per_rank in enumerate(world4):
        assert per_rank["ep4"]["shapes"]["experts.w_down"] == (2, checks.HIDDEN, checks.FFN)
        got = per_rank["ep2-etp2"]
        # mesh (ep, tp): rank = 2 * ep_rank + tp_rank
        assert (got["first"], got["count"], got["shard"]) == (4 * (rank // 2), 4, rank % 2)
        assert got["shapes"]["experts.w_up"] == (4, checks.FFN // 2, checks.HIDDEN)
        assert got["shapes"]["experts.w_down"] == (4, checks.HIDDEN, checks.FFN // 2)
        assert got["shapes"]["router.weight"] == (checks.EXPERTS, checks.HIDDEN)


def test_capacity_drops_tokens_in_these_runs():
    """The capacity layouts test something: the reference with capacity differs from the dropless one."""
    dropless, capped = reference(2, "base"), reference(2, "capacity-pad")
    assert not torch.allclose(dropless["out"][0], capped["out"][0], rtol=RTOL, atol=ATOL)


def test_the_comparison_sees_one_wrong_expert_gradient(world4):
    got = dict(world4[1]["ep2-etp2"])
    grads = dict(got["grads"])
    grads["experts.w_down"] = grads["experts.w_down"] * 1.001
    got["grads"] = grads
    assert [m for m in compare(got, reference(4, "base"), 1) if "w_down" in m]
    got = dict(world4[1]["ep2-etp2"], shard=0)     # the wrong ETP shard
    assert compare(got, reference(4, "base"), 1)
