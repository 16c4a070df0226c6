"""bench/hsdp.py's peak measurement on CPU (``PeakRise``: torch's profiler memory events summed in time
order, ``high_water``) against hand-computed cases: what is allocated and freed before the peak, what
is still live, and what is given back to the allocator, in bytes as requested."""

import torch

from bench.hsdp import PeakRise, high_water

MB = 1_000_000


def test_high_water_is_the_highest_running_sum_above_the_start():
    assert high_water([]) == 0
    assert high_water([-5, -5]) == 0  # only frees: never above the start
    assert high_water([4, -4, 8, 1, -8]) == 9
    assert high_water([3, 3, -6, 5]) == 6


def test_allocate_free_allocate_peaks_at_the_larger():
    with PeakRise() as measured:
        a = torch.empty(MB, dtype=torch.uint8)  # x = 1 MB
        del a
        b = torch.empty(3 * MB, dtype=torch.uint8)  # y = 3 MB
        del b
    assert measured.rise == 3 * MB


def test_what_stays_live_adds_to_what_comes_after():
    with PeakRise() as measured:
        kept = torch.empty(2 * MB, dtype=torch.uint8)
        tmp = torch.empty(MB, dtype=torch.uint8)
        del tmp
        tmp = torch.empty(1_500_000, dtype=torch.uint8)
        del tmp
    assert measured.rise == 3_500_000
    assert kept.numel() == 2 * MB


def test_only_what_follows_the_mark_counts_and_frees_after_it_lower_the_level():
    with PeakRise() as measured:
        before = torch.empty(4 * MB, dtype=torch.uint8)  # recorded, before the mark
        big = torch.empty(9 * MB, dtype=torch.uint8)
        del big  # a rise before the mark: not counted
        measured.mark()
        del before  # -4 MB below the mark's level
        a = torch.empty(3 * MB, dtype=torch.uint8)  # still 1 MB below it
        del a
        b = torch.empty(5 * MB, dtype=torch.uint8)  # 1 MB above it
        del b
    assert measured.rise == MB


def test_a_pooled_block_reused_is_no_allocation():
    from hyper_adaptor.parallel.hsdp import HostBufferPool

    pool = HostBufferPool()
    pool.give(pool.take(MB, torch.float32, torch.device("cpu")))  # held before: the caller's baseline
    with PeakRise() as measured:
        block = pool.take(MB, torch.float32, torch.device("cpu"))
        pool.give(block)
        fresh = pool.take(2 * MB, torch.float32, torch.device("cpu"))  # does not fit: allocated
        pool.give(fresh)
    assert measured.rise == 8 * MB
