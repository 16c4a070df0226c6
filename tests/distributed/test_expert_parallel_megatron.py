"""Level 2: megatron's ``MoELayer`` with ``--moe-dispatcher-engine hyper`` against one process and against
megatron's own all-to-all dispatcher.

The layer, weights, data and comparison are test_moe_dispatchers.py's (tests/distributed/
moe_dispatcher_checks.py: 4 experts, top-2, aux-loss router, GeLU experts, local spec): the loss, every
rank's output and input gradient, the router's and each expert's weight gradient equal the
single-process layer's (EP 1, TP 1, megatron's dispatcher, one call per data-parallel chunk) within
1e-5 (fp32; the engine weights the expert outputs by the router's probabilities after the experts'
second projection where megatron weights the activation before it, and sums in another order), at
EP 2 (2 ranks), EP 4 and EP 2 x TP 2 with sequence parallel and expert tensor parallel 1 and 2
(4 ranks); with token dropping (probabilities and position policies) with and without padding to
capacity, a shared expert with and without megatron's ``--moe-shared-expert-overlap`` (served by the
engine's dispatcher), sigmoid scores with the expert bias and the per-sequence aux loss, top-1 with
``moe_apply_probs_on_input``, megatron's selective recompute of the MoE layer, the engine's chunked
overlap (``--moe-dispatch-chunks`` 2 and 3), and level 1's grouped GEMM serving megatron's experts.
Every engine run must have gone through the engine's entry point for its path (counted:
``AllToAllDispatcher.dispatch``, or ``overlapped_moe_forward`` for chunks and for the shared expert
computed during the dispatch), so without the patch these tests fail; megatron's own dispatcher runs
beside it at the same layouts, its results equal to the engine's within the same tolerance, and the
overlapped schedule equals the plain one within 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.moe_dispatcher_checks import FFN
from tests.distributed.test_moe_dispatchers import VARIANTS as LEVEL0_VARIANTS
from tests.distributed.test_moe_dispatchers import compare, world_fixture

pytestmark = pytest.mark.distributed

TARGET = "tests.distributed.expert_parallel_checks"
RTOL = ATOL = 1e-5

SHARED = dict(moe_shared_expert_intermediate_size=FFN)
VARIANTS = {
    "base": {},
    "capacity": LEVEL0_VARIANTS["capacity"],
    # capacity below the mean load: copies dropped, sizes stay dynamic (no padding)
    "drop": dict(moe_expert_capacity_factor=0.75),
    "drop-position": dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="position"),
    "shared": SHARED,
    "shared-sigmoid-seq-aux": LEVEL0_VARIANTS["shared-sigmoid-seq-aux"],
    "top1-probs-on-input": dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True),
    # megatron's selective recompute of the whole MoE layer: dispatch and combine run again in the backward
    "recompute": dict(SHARED, recompute_granularity="selective", recompute_modules=["moe"]),
}
# runs whose config differs from their reference only in how the work is scheduled
OVERLAP = dict(SHARED, moe_shared_expert_overlap=True)


def run(ep, tp=1, etp=1, variant="base", engine=True, overlap=False, **more):
    extra = dict(VARIANTS[variant], **(OVERLAP if overlap else {}))
    return dict(ep=ep, tp=tp, etp=etp, extra=extra, engine=engine, reference=variant, overlap=overlap, **more)


# megatron's own dispatcher first: once the engine (or level 1) is on it stays on in the process
WORLD2 = {
    "megatron-ep2": run(2, engine=False),
    "megatron-ep2-shared-overlap": run(2, variant="shared", overlap=True, engine=False),
    "engine-ep2": run(2),
    "engine-ep2-capacity": run(2, variant="capacity"),
    "engine-ep2-drop": run(2, variant="drop"),
    "engine-ep2-drop-position": run(2, variant="drop-position"),
    "engine-ep2-shared": run(2, variant="shared"),
    "engine-ep2-shared-overlap": run(2, variant="shared", overlap=True),
    "engine-ep2-shared-sigmoid-seq-aux": run(2, variant="shared-sigmoid-seq-aux"),
    "engine-ep2-top1-probs-on-input": run(2, variant="top1-probs-on-input"),
    "engine-ep2-recompute": run(2, variant="recompute"),
    "engine-ep2-chunks2-shared-overlap-recompute": run(2, variant="recompute", overlap=True, chunks=2),
    "engine-ep2-chunks2": run(2, chunks=2),
    "engine-ep2-chunks3-drop": run(2, variant="drop", chunks=3),
    "engine-ep2-chunks2-top1-probs-on-input": run(2, variant="top1-probs-on-input", chunks=2),
    "engine-ep2-grouped-level1": run(2, grouped=True, level=1),
    "engine-ep2-shared-overlap-grouped-level1": run(2, variant="shared", overlap=True, grouped=True, level=1),
    "engine-ep2-chunks2-shared-overlap-grouped-level1": run(2, variant="shared", overlap=True, grouped=True,
                                                            level=1, chunks=2),
}
WORLD4 = {
    "megatron-ep2-tp2-etp2": run(2, 2, 2, engine=False),
    "megatron-ep2-tp2-etp1-shared-overlap": run(2, 2, 1, variant="shared", overlap=True, engine=False),
    "engine-ep4": run(4),
    "engine-ep4-capacity": run(4, variant="capacity"),
    "engine-ep2-tp2-etp1": run(2, 2, 1),
    "engine-ep2-tp2-etp2": run(2, 2, 2),
    "engine-ep2-tp2-etp1-shared-overlap": run(2, 2, 1, variant="shared", overlap=True),
    "engine-ep2-tp2-etp2-shared-overlap": run(2, 2, 2, variant="shared", overlap=True),
    "engine-ep4-chunks2": run(4, chunks=2),
    "engine-ep2-tp2-etp1-chunks2-shared-overlap": run(2, 2, 1, variant="shared", overlap=True, chunks=2),
    "engine-ep2-tp2-etp2-shared-sigmoid-seq-aux": run(2, 2, 2, variant="shared-sigmoid-seq-aux"),
    "engine-ep2-tp2-etp2-grouped-level1": run(2, 2, 2, grouped=True, level=1),
}
# the engine's result against megatron's own dispatcher at the same layout
SIDE_BY_SIDE = {"engine-ep2": "megatron-ep2", "engine-ep2-shared-overlap": "megatron-ep2-shared-overlap",
                "engine-ep2-tp2-etp2": "megatron-ep2-tp2-etp2",
                "engine-ep2-tp2-etp1-shared-overlap": "megatron-ep2-tp2-etp1-shared-overlap"}


def _sent(runs: dict) -> dict:
    return {name: {k: v for k, v in r.items() if k not in ("reference", "overlap")} for name, r in runs.items()}


@pytest.fixture(scope="module")
def reference(moe_reference):
    return moe_reference  # tests/distributed/conftest.py (test_moe_dispatchers.py reads it too)


world2 = world_fixture(2, f"{TARGET}:layouts", _sent(WORLD2), timeout=400)
world4 = world_fixture(4, f"{TARGET}:layouts", _sent(WORLD4), timeout=500)


def _path(spec) -> dict:
    """How often a run must have called each of the engine's entry points (one layer call)."""
    if not spec["engine"]:
        return {"dispatch": 0, "overlapped": 0}
    padded = VARIANTS[spec["reference"]].get("moe_pad_expert_input_to_capacity", False)
    overlapped = (spec.get("chunks", 1) > 1 or spec["overlap"]) and spec["etp"] == 1 and not padded
    calls = 2 if "recompute_modules" in VARIANTS[spec["reference"]] else 1  # forward, and again in the backward
    return {"dispatch": 0 if overlapped else calls, "overlapped": calls if overlapped else 0}


def _check(world, runs, reference, name, size):
    spec = runs[name]
    for rank, results in enumerate(world):
        got = results[name]
        assert not isinstance(got, str), f"rank {rank}: {got[:600]}"
        assert compare(got, reference[spec["reference"]], size // spec["tp"]) == [], (rank, name)
        assert got["engine_calls"] == _path(spec), (rank, name, got["engine_calls"])
        grouped = spec.get("level") == 1 and spec["ep"] < 4
        assert (got["grouped_gemm_calls"] > 0) == grouped, (rank, name, got["grouped_gemm_calls"])


@pytest.mark.parametrize("name", list(WORLD2))
def test_two_ranks_match_one_process(world2, reference, name):
    _check(world2, WORLD2, reference, name, 2)


@pytest.mark.parametrize("name", list(WORLD4))
def test_four_ranks_match_one_process(world4, reference, name):
    _check(world4, WORLD4, reference, name, 4)


@pytest.mark.parametrize("engine, megatron", list(SIDE_BY_SIDE.items()))
def test_the_engine_equals_megatrons_dispatcher_at_the_same_layout(world2, world4, engine, megatron):
    world = world2 if engine in WORLD2 else world4
    for rank, results in enumerate(world):
        ours, theirs = results[engine], results[megatron]
        assert not isinstance(theirs, str), f"rank {rank}: {theirs[:600]}"
        for key in ("loss", "out", "x_grad", "router_grad"):
            assert torch.allclose(ours[key], theirs[key], rtol=RTOL, atol=ATOL), (rank, engine, key)
        assert ours["grads"].keys() == theirs["grads"].keys()
        for key, grad in ours["grads"].items():
            assert torch.allclose(grad, theirs["grads"][key], rtol=RTOL, atol=ATOL), (rank, engine, key)


# overlap on against off: the same sums, launched and waited in another order (and, with chunks, the
# experts' GEMMs over fewer rows each): equal within float rounding, not bitwise
OVERLAP_PAIRS = {"engine-ep2-shared-overlap": "engine-ep2-shared", "engine-ep2-chunks2": "engine-ep2"}


@pytest.mark.parametrize("overlapped, plain", list(OVERLAP_PAIRS.items()))
def test_overlap_on_equals_overlap_off(world2, overlapped, plain):
    for rank, results in enumerate(world2):
        ours, theirs = results[overlapped], results[plain]
        for key in ("loss", "out", "x_grad", "router_grad"):
            assert torch.allclose(ours[key], theirs[key], rtol=1e-6, atol=1e-6), (rank, overlapped, key)
        for key, grad in ours["grads"].items():
            assert torch.allclose(grad, theirs["grads"][key], rtol=1e-6, atol=1e-6), (rank, overlapped, key)


def test_the_comparison_sees_one_wrong_expert_gradient(world2, reference):
    got = dict(world2[0]["engine-ep2"])
    key = next(iter(got["grads"]))
    got["grads"] = {**got["grads"], key: got["grads"][key] * 1.001}
    assert [m for m in compare(got, reference["base"], 2) if "gradient" in m]
