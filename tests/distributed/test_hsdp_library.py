"""HSDP as a library (hyper_adaptor.parallel.hsdp), on 4 gloo ranks, against one process.

Tolerances (fp32): losses 1e-6 relative, every full parameter after 3 Adam steps 1e-6 absolute.
bf16 compute: losses within 3e-2 relative of the fp32 reference (8 mantissa bits).
"""

import pytest
import torch

from hyper_adaptor.testing import run_world

pytestmark = pytest.mark.distributed
TARGET = "tests.distributed.hsdp_checks"


def matrix_and_extras(rank: int, world_size: int) -> dict:
    from tests.distributed import hsdp_checks

    return {"matrix": hsdp_checks.level_matrix(rank, world_size), "extras": hsdp_checks.extras(rank, world_size)}


@pytest.fixture(scope="module")
def world():
    # the level matrix and the extras in one 4-rank world (each world costs a start-up of every rank)
    return run_world(4, "tests.distributed.test_hsdp_library:matrix_and_extras", timeout=800)[0]


@pytest.fixture(scope="module")
def matrix(world):
    return world["matrix"]


@pytest.fixture(scope="module")
def extras(world):
    return world["extras"]


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
@pytest.mark.parametrize("shard_size", [2, 4])
@pytest.mark.parametrize("comm_async", ["sync", "async"])
@pytest.mark.parametrize("fusion", ["per-param", "fused"])
def test_matches_single_process(matrix, level, shard_size, comm_async, fusion):
    assert matrix[f"{level}-S{shard_size}-{comm_async}-{fusion}"] == []


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
@pytest.mark.parametrize("shard_size", [2, 4])
def test_grad_accumulation_over_four_micro_batches(extras, level, shard_size):
    assert extras["accumulation"][f"noSync-{level}-S{shard_size}"] == []


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
@pytest.mark.parametrize("shard_size", [2, 4])
def test_two_synced_backwards_accumulate_exactly(extras, level, shard_size):
    assert extras["accumulation"][f"sync2-{level}-S{shard_size}"] == []


def test_threshold_keeps_small_parameters_whole(extras):
    info = extras["structure"]["level1"]
    for name, entry in info.items():
        big = name.endswith("weight") and ("fc" in name or "emb" in name)
        assert entry["sharded"] is big, name
        if big:
            rows = entry["full_shape"][0]
            assert entry["local_shape"][0] == -(-rows // 4), name  # ceil(rows / 4) on rank 0
        else:
            assert entry["local_shape"] == entry["full_shape"], name


def test_levels_keep_what_they_promise(extras):
    s = extras["structure"]
    w = "blocks.0.fc1.weight"
    # level 1: full parameter and full gradient kept; shard gradient is 1/4
    assert s["level1"][w]["full_storage"] > 0 and s["level1"][w]["full_grad"] == (36, 16)
    assert s["level1"][w]["grad_local_shape"] == (9, 16)
    # level 2: full parameter kept, full gradient released
    assert s["level2"][w]["full_storage"] > 0 and s["level2"][w]["full_grad"] is None
    # level 3: neither kept between steps
    assert s["level3"][w]["full_storage"] == 0 and s["level3"][w]["full_grad"] is None
    assert s["level3"][w]["grad_local_shape"] == (9, 16)


@pytest.mark.parametrize("level", ["level1", "level3"])
def test_clip_grad_norm_matches_reference(extras, level):
    r = extras["clip"][level]
    assert abs(r["norm"] - r["ref_norm"]) <= 1e-5 * r["ref_norm"]
    assert r["ref_norm"] > 0.5  # so clipping really happened
    assert r["max_grad_diff"] < 1e-6


BF16_GRAD_RTOL = 3e-2  # per parameter, ||got - want|| / ||want||, first step (same weights on both sides)


def _bf16_grad_errors(grads: dict, ref: dict) -> dict:
    return {name: ((grads[name] - want).norm() / want.norm()).item() for name, want in ref.items()}


def test_bf16_compute_with_fp32_master(extras):
    r = extras["bf16"]
    assert r["gathered_dtype"] == "torch.bfloat16" and r["shard_dtype"] == "torch.float32"
    assert len(r["losses"]) == len(r["ref"]) > 0
    for got, want in zip(r["losses"], r["ref"]):
        assert abs(got - want) <= 3e-2 * abs(want), (r["losses"], r["ref"])
    assert r["losses"] != r["ref"]
    assert set(r["grads"]) == set(r["ref_grads"]) and r["grads"]
    errors = _bf16_grad_errors(r["grads"], r["ref_grads"])
    assert max(errors.values()) <= BF16_GRAD_RTOL, errors


def test_bf16_gradient_tolerance_catches_one_gradient_off_by_10_percent(extras):
    r = extras["bf16"]
    for name in r["ref_grads"]:
        for factor in (1.1, 0.9):
            wrong = dict(r["grads"], **{name: r["grads"][name] * factor})
            assert _bf16_grad_errors(wrong, r["ref_grads"])[name] > BF16_GRAD_RTOL, (name, factor)


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_offload_matches_and_keeps_shards_and_optimizer_state_on_the_host(extras, level):
    assert extras["offload"][level]["problems"] == []
    assert extras["offload"][level]["devices"] == ["cpu"]


def test_gloo_reduce_scatter_and_all_gather_as_all_to_all_match(extras):
    r = extras["collectives"]
    assert r["problems"] == []
    # 2 ops x 2 paths x 2 groups x 2 dtypes x sync/async (rank 0 is in both groups)
    assert len(r["used"]) == 32
    native = {"rs": ["reduce_scatter_tensor"], "ag": ["all_gather_into_tensor"]}
    for key, used in r["used"].items():
        op, path = key.split("-")[:2]
        # the all-to-all exchange: point-to-point sends and receives between every pair of members
        assert used == (["isend", "irecv"] if path == "a2a" else native[op]), key


@pytest.mark.parametrize("level", ["level1", "level3"])
def test_gloo_switches_and_buffer_pool_are_per_module(extras, level):
    r = {name: extras["per_object"][f"{level}-{name}"] for name in ("gloo", "a2a", "rs-a2a")}
    for name, variant in r.items():
        assert variant["problems"] == [], name
        # its own pool served every host buffer; the other modules' pools were not touched
        assert variant["takes"][name] > 0, name
        assert all(n == 0 for other, n in variant["takes"].items() if other != name), (name, variant["takes"])
    calls = {name: variant["calls"] for name, variant in r.items()}
    assert calls["gloo"]["isend"] == 0, calls
    assert calls["gloo"]["reduce_scatter_tensor"] > 0 and calls["gloo"]["all_gather_into_tensor"] > 0, calls
    assert calls["a2a"]["isend"] > 0, calls
    assert calls["a2a"]["reduce_scatter_tensor"] == calls["a2a"]["all_gather_into_tensor"] == 0, calls
    # one switch on, the other off: the reduce-scatters are all-to-all exchanges (point-to-point
    # messages), the all-gathers gloo's own
    assert calls["rs-a2a"]["isend"] > 0 and calls["rs-a2a"]["reduce_scatter_tensor"] == 0, calls
    assert calls["rs-a2a"]["all_gather_into_tensor"] > 0, calls


def test_level3_keeps_root_and_last_unit_gathered_until_backward(extras):
    r = extras["reshard_schedule"]
    default, everything = r["default"], r["reshard-all"]
    assert default["problems"] == [] and everything["problems"] == []
    assert default["between"] == {"root": True, "blocks.0": False, "blocks.1": False, "blocks.2": True}
    assert everything["between"] == {"root": False, "blocks.0": False, "blocks.1": False, "blocks.2": False}
    for variant in (default, everything):
        # a unit's full parameters are freed once its gradients are packed, not at the end of backward
        assert variant["during_backward"] == {"root": True, "blocks.0": False, "blocks.1": False, "blocks.2": False}
        assert not any(variant["after_backward"].values())
        assert not any(variant["after_no_grad"].values())
    # the two kept units are not gathered a second time for backward: fewer bytes, never more
    assert 0 < default["step_bytes"] < everything["step_bytes"]
    assert "reshard_after_forward must be a bool" in r["bad_value"]


@pytest.mark.parametrize("level", ["level2", "level3"])
def test_sync_reduction_keeps_one_in_flight_async_keeps_all(extras, level):
    sync, overlapped = extras["in_flight"][f"{level}-sync"], extras["in_flight"][f"{level}-async"]
    assert sync["most"] == 1 and sync["left"] == 0 and sync["overlapped"] >= 3
    assert overlapped["most"] > 1 and overlapped["left"] == 0


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_communication_buffers_stay_within_the_bucket_size(extras, level):
    """bucket_size smaller than the model: no communication buffer of a step (pooled or allocated by
    _bucket.py) and no block the pool keeps afterwards is larger than the bucket; parity holds."""
    r = extras["bucket_bound"]
    got = r[level]
    assert got["problems"] == []
    assert got["model_bytes"] > 4 * r["bucket_bytes"] and got["buffers"] > 0  # the bound is not vacuous
    assert got["largest_buffer"] <= r["bucket_bytes"], got
    assert 0 < got["largest_pooled_after"] <= r["bucket_bytes"], got


def _gathers(steps: list, phase: str) -> list[list[str]]:
    return [[unit for when, unit, _ in events if when == phase] for events in steps]


def test_level3_recompute_gathers_no_unit_whose_backward_is_done(extras):
    """Every block checkpointed: the forward rerun inside backward starts no forward prefetch (the next
    block's backward is done) and keeps its block gathered for the backward that follows (no second
    all-gather of it); the gradients, losses and parameters are bitwise those of the run without
    checkpointing, which matches the single-process reference."""
    r = extras["recompute"]
    plain = r["plain"]
    assert plain["problems"] == []
    units = ["root", "blocks.0", "blocks.1", "blocks.2"]
    # level 3's default: the root and the last block stay gathered from forward to backward
    assert _gathers(plain["steps"], "forward") == [units] * 3
    assert _gathers(plain["steps"], "backward") == [["blocks.1", "blocks.0"]] * 3
    for name in ("reentrant", "non-reentrant"):
        got = r[name]
        done = [(step, unit) for step, events in enumerate(got["steps"]) for when, unit, was_done in events
                if was_done]
        assert done == [], (name, got["steps"])
        assert _gathers(got["steps"], "forward") == [units] * 3, name
        # the reentrant checkpoint runs the blocks' first forward without grad, so the last block is freed
        # after it like the others and its backward gathers it again (the root's backward prefetch); each
        # block is gathered once in backward
        again = ["blocks.2"] if name == "reentrant" else []
        assert _gathers(got["steps"], "backward") == [again + ["blocks.1", "blocks.0"]] * 3, (name, got["steps"])
    # all three blocks in one region: blocks.2 comes from the root's backward prefetch, blocks.0 and blocks.1
    # are gathered as the region is rerun (only the latest two rebuilt blocks stay whole: blocks.0 is freed as
    # blocks.2's rerun begins and gathered again by blocks.1's backward prefetch)
    region = r["reentrant-region3"]
    assert not any(was_done for events in region["steps"] for _, _, was_done in events), region["steps"]
    assert _gathers(region["steps"], "backward") == [["blocks.2", "blocks.0", "blocks.1", "blocks.0"]] * 3
    for name in ("reentrant", "non-reentrant", "reentrant-region3"):
        got = r[name]
        assert got["losses"] == plain["losses"], name
        assert set(got["grads"]) == set(plain["grads"]) and got["grads"]
        for key, want in plain["grads"].items():
            assert torch.equal(got["grads"][key], want), (name, key)
        for key, want in plain["params"].items():
            assert torch.equal(got["params"][key], want), (name, key)
