"""hyper_adaptor.testing.measure, what every bench measures with: the storage tracker's peak against
hand-computed cases (frees in another thread included, as gloo's workers free the buffers of finished
sends), and the collective counter's calls and bytes in a real 2-rank gloo world."""

import threading

import pytest
import torch

from hyper_adaptor.testing import run_world
from hyper_adaptor.testing.measure import (
    BUFFER_BYTES,
    SENT_BYTES,
    CollectiveCounter,
    PeakMemory,
    StorageTracker,
    mib,
    nbytes,
    quick_json,
)

MB = 1_000_000


def block(n):
    return torch.empty(n, dtype=torch.uint8)


def test_bytes_helpers():
    assert nbytes(torch.zeros(3, dtype=torch.float32)) == 12
    assert nbytes([torch.zeros(2), (torch.zeros(1, dtype=torch.float64), "x")]) == 16
    assert nbytes(None) == 0
    assert mib(3 * 2**20) == "3.00" and mib(None) == "-" and mib(2**19, "8.1f") == "     0.5"
    assert quick_json("bench/results/hsdp.json", True).name == "hsdp-quick.json"
    assert quick_json("bench/results/hsdp.json", False).name == "hsdp.json"


def test_all_to_all_single_sent_bytes_take_split_sizes_in_every_form():
    """megatron's MoE dispatcher hands its split sizes as tensors (numpy on CUDA); what a rank sends is
    its input less the block it keeps."""
    import numpy as np

    sent = SENT_BYTES["all_to_all_single"]
    x = torch.zeros(10, 2)  # 80 bytes, rows split 1 / 3 / 6 over ranks 0-2
    for split in ([1, 3, 6], torch.tensor([1, 3, 6]), np.array([1, 3, 6])):
        assert sent({"input": x, "input_split_sizes": split}, 3, 1) == 80 - 24
    assert sent({"input": x, "input_split_sizes": None}, 2, 0) == 40
    assert sent({"input": torch.zeros(0, 2), "input_split_sizes": [0, 0]}, 2, 0) == 0


def test_allocate_free_allocate_peaks_at_the_larger():
    with PeakMemory("cpu") as measured:
        a = block(MB)
        del a
        b = block(3 * MB)
        del b
    assert measured.rise == 3 * MB


def test_what_stays_live_adds_to_what_comes_after():
    with PeakMemory("cpu") as measured:
        kept = block(2 * MB)
        tmp = block(MB)
        del tmp
        tmp = block(1_500_000)
        del tmp
    assert measured.rise == 3_500_000
    assert kept.numel() == 2 * MB


def test_only_what_follows_the_mark_counts_and_frees_after_it_lower_the_level():
    with PeakMemory("cpu") as measured:
        before = block(4 * MB)  # seen created, before the mark
        big = block(9 * MB)
        del big  # a rise before the mark: not counted
        measured.mark()
        del before  # -4 MB below the mark's level
        a = block(3 * MB)  # still 1 MB below it
        del a
        b = block(5 * MB)  # 1 MB above it
        del b
    assert measured.rise == MB


def test_a_free_in_another_thread_lowers_the_level():
    held = []
    with PeakMemory("cpu") as measured:
        held.append(block(4 * MB))
        measured.mark()
        worker = threading.Thread(target=held.clear)  # the last reference dropped there, as gloo's workers do
        worker.start()
        worker.join()
        b = block(4 * MB)  # takes the freed block's place: no rise
        del b
    assert measured.rise == 0


def test_tensors_made_before_it_views_and_in_place_results_are_not_new():
    x = torch.zeros(MB, dtype=torch.uint8)
    with StorageTracker() as tracker:
        x.add_(1)
        v = x.view(1000, 1000)
        y = v + 1  # the one new storage
    assert tracker.peak == MB and tracker.alive_bytes() == MB
    assert tracker.alive_bytes(exclude=lambda ptr: ptr == y.data_ptr()) == 0
    assert tracker.peak_by_op() == {"aten.add": MB}


def test_a_pooled_block_reused_is_no_allocation():
    from hyper_adaptor.parallel.hsdp import HostBufferPool

    pool = HostBufferPool()
    pool.give(pool.take(MB, torch.float32, torch.device("cpu")))  # held before: the caller's baseline
    with PeakMemory("cpu") as measured:
        block_ = pool.take(MB, torch.float32, torch.device("cpu"))
        pool.give(block_)
        fresh = pool.take(2 * MB, torch.float32, torch.device("cpu"))  # does not fit: allocated
        pool.give(fresh)
    assert measured.rise == 8 * MB


def test_skip_leaves_out_what_is_made_while_it_is_true():
    skipping = [True]
    with StorageTracker(skip=lambda: skipping[0]) as tracker:
        a = block(MB)
        skipping[0] = False
        b = block(2 * MB)
    assert tracker.alive_bytes() == 2 * MB and a.numel() + b.numel() == 3 * MB


def counter_rank(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    alone = dist.new_group([0]), dist.new_group([1])
    out, original = {}, dist.all_reduce
    for convention, volume in (("sent", SENT_BYTES), ("buffer", BUFFER_BYTES)):
        with CollectiveCounter(volume) as counter:
            x = torch.ones(1000)  # 4000 bytes
            dist.all_reduce(x)  # not counted: no phase set
            counter.phase = "step"
            dist.all_reduce(x)
            dist.all_gather_into_tensor(torch.empty(2000), x)
            dist.reduce_scatter_tensor(torch.empty(500), torch.ones(1000))
            works = [dist.isend(x, dst=1 - rank), dist.irecv(torch.empty(1000), src=1 - rank)]
            for work in works:
                work.wait()
            dist.all_reduce(x, group=alone[rank])
            counter.phase = None
            out[convention] = counter.take()
        out[f"{convention}_restored"] = dist.all_reduce is original
    return out


@pytest.mark.timeout(180)
def test_the_counter_counts_each_collective_once_in_both_conventions():
    results = run_world(2, "tests.unit.test_measure:counter_rank", timeout=150)
    for r in results:
        assert r["sent_restored"] and r["buffer_restored"]
        sent, buffer = r["sent"]["step"]["ops"], r["buffer"]["step"]["ops"]
        alone = "all_reduce (group of 1, not counted)"
        # what this rank sends, (N-1)/N of each buffer: all-reduce 2(N-1)/N x 4000, all-gather (N-1) x 4000,
        # reduce-scatter (N-1) x its 2000-byte output, the send itself
        assert sent == {"all_reduce": {"calls": 1, "bytes": 4000},
                        "all_gather_into_tensor": {"calls": 1, "bytes": 4000},
                        "reduce_scatter_tensor": {"calls": 1, "bytes": 2000},
                        "isend": {"calls": 1, "bytes": 4000}, alone: {"calls": 1, "bytes": 0}}
        assert r["sent"]["step"]["bytes"] == 14000
        # the ZeRO convention: the full buffer, all-reduce twice it, a send N/(N-1) x, a receive 0
        assert buffer == {"all_reduce": {"calls": 1, "bytes": 8000},
                          "all_gather_into_tensor": {"calls": 1, "bytes": 8000},
                          "reduce_scatter_tensor": {"calls": 1, "bytes": 4000},
                          "isend": {"calls": 1, "bytes": 8000}, "irecv": {"calls": 1, "bytes": 0},
                          alone: {"calls": 1, "bytes": 0}}
