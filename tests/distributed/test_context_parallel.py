"""The context-parallel library (hyper_adaptor.parallel.context) on 2 and 4 gloo ranks, against one process.

Every algorithm (Ulysses, all-gather, ring, hybrid 2x2 on 4 ranks), causal and not, load-balanced and
contiguous shards, MHA and GQA (kv heads 4, 2, 1 for 4 query heads: fewer kv heads than ranks included),
fp32 and bf16: the output and the q/k/v gradients of each rank's shard against single-process eager
``attention()`` + autograd over the whole sequence; the ContextParallel style on a small core-attention
module against the same module unsharded; bad arguments. Rank functions: cp_engine_checks.py.

Tolerances:
- fp32: max absolute error 1e-5 on out, dq, dk, dv (values are O(1); measured <= ~2e-6: the block order
  and the kernels' summation order differ from the reference, nothing else);
- bf16 (inputs rounded to bf16 once, reference computed in fp32 on those same values): per tensor
  ||got - want|| / ||want|| <= 2e-2. bf16 keeps 8 mantissa bits (unit roundoff 2^-9 ~ 2e-3); the output
  and every gradient pass through several bf16 roundings (all-to-all of bf16 shards, kernels in bf16,
  gradients reduced in bf16); measured 2e-3 .. 6e-3. A tensor 10% off is caught (checked below).
"""

import pytest

from hyper_adaptor.testing import run_world

pytestmark = pytest.mark.distributed
TARGET = "tests.distributed.cp_engine_checks"
FP32_ATOL = 1e-5
BF16_RTOL = 2e-2
TENSORS = ("out", "dq", "dk", "dv")


@pytest.fixture(scope="module")
def two():
    return run_world(2, f"{TARGET}:world_two", timeout=180)


@pytest.fixture(scope="module")
def four():
    return run_world(4, f"{TARGET}:world_four", timeout=240)


def assert_close(case: dict, label: str):
    assert case["shapes_ok"], label
    for name in TENSORS:
        if label.endswith("bf16"):
            assert case[name]["rel"] <= BF16_RTOL, (label, name, case[name])
            assert case[name]["rel_off_10pct"] > BF16_RTOL, (label, name, case[name])
        else:
            assert case[name]["max_abs"] <= FP32_ATOL, (label, name, case[name])


def assert_matrix(results, section, expected_cases):
    for rank, result in enumerate(results):
        cases = result[section]
        assert len(cases) == expected_cases, sorted(cases)
        for label, case in cases.items():
            assert_close(case, f"rank{rank}-{section}-{label}")


def test_two_ranks_every_algorithm_layout_and_head_count(two):
    # 3 algorithms x (4 layouts x 3 kv-head counts fp32 + 3 bf16 cases)
    assert_matrix(two, "engine", 3 * (12 + 3))


def test_four_ranks_every_algorithm_layout_and_head_count(four):
    assert_matrix(four, "engine", 4 * (12 + 3))


def test_four_ranks_two_cp_groups_of_strided_ranks(four):
    # CP groups [0, 2] and [1, 3]: positions are group ranks, neighbours are global ranks 2 apart
    assert_matrix(four, "strided", 3 * (8 + 3))


def test_hybrid_groups_are_ulysses_neighbours_and_ring_strides(four):
    for rank, result in enumerate(four):
        m = result["membership"]
        assert m["cp"] == [0, 1, 2, 3]
        assert m["ulysses"] == ([0, 1] if rank < 2 else [2, 3]), (rank, m)
        assert m["ring"] == ([0, 2] if rank % 2 == 0 else [1, 3]), (rank, m)
        assert m["strided"] == ([0, 2] if rank % 2 == 0 else [1, 3]), (rank, m)


def test_hybrid_runs_a_load_balanced_ring_of_two(four):
    # ring of G = 2 groups, load-balanced causal: the own block causal, then one half-sized unmasked block
    # (its masked half skipped) - the ring really ran on the Ulysses output
    for result in four:
        stats = result["hybrid_stats"]
        assert (stats["blocks_causal"], stats["blocks_full"], stats["blocks_skipped"]) == (1, 1, 1), stats
        assert stats["bytes_sent"] > 0, stats


def test_style_matches_the_unsharded_module_on_two_ranks(two):
    # ulysses, allgather, ring x (lb, contiguous, [b, h, s, d] SDPA module with one kv head) + Ulysses bf16
    assert_matrix(two, "style", 3 * 3 + 1)


def test_style_matches_the_unsharded_module_on_four_ranks(four):
    assert_matrix(four, "style", 4 * 3 + 1)


def test_style_on_the_cp_dimension_of_a_two_by_two_mesh(four):
    assert_matrix(four, "style_submesh", 2 * 3 + 1)


BAD = {
    "degree_not_dividing": ["ulysses_degree", "divide", "got 3"],
    "ulysses_algo_partial_degree": ["ulysses_degree", "algo='ulysses'"],
    "hybrid_whole_degree": ["ulysses_degree", "strictly between", "algo='hybrid'"],
    "two_d_mesh": ["device_mesh must be 1-D", "2-D"],
    "applied_twice": ["already has a ContextParallel style"],
    "mask_passed": ["positional argument 4", "must be None"],
    "heads_not_divisible": ["query heads (3)", "Ulysses degree"],
    "odd_rows_load_balanced": ["load_balanced", "even", "s_local=5"],
    "unknown_algo": ["algo must be one of", "'p2p'"],
    "cp_group_mismatch": ["cp_group holds ranks", "cp_rank_lists"],
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_raise_before_communicating(two, four, case):
    for results in (two, four):
        for result in results:
            message = result["bad"][case]
            for word in BAD[case]:
                assert word in message, (case, message)
