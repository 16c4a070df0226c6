"""HSDP's CPU buffer pool (hyper_adaptor/parallel/hsdp/_pool.py: HostBufferPool): a block given back
is handed out again to a request it fits, never while it is out, and at most ``keep`` blocks stay;
HSDP's gloo collectives take their buffers from the pool they are given and give them back once the
transfer is done."""

import pytest
import torch

from hyper_adaptor.parallel.hsdp import HostBufferPool, _collectives

CPU = torch.device("cpu")


def test_a_given_block_is_reused_for_a_request_it_fits():
    pool = HostBufferPool()
    a = pool.take(100, torch.float32, CPU)
    ptr = a.data_ptr()
    pool.give(a)
    b = pool.take(60, torch.float32, CPU)
    assert b.data_ptr() == ptr and b.numel() == 60
    assert pool.reserved_bytes() == 0  # it is out again


def test_a_block_that_is_out_is_never_handed_out_twice():
    pool = HostBufferPool()
    a = pool.take(100, torch.float32, CPU)
    pool.give(a)
    pool.give(a)  # twice: kept once
    c = pool.take(100, torch.float32, CPU)
    assert c.data_ptr() == a.data_ptr()
    d = pool.take(100, torch.float32, CPU)  # a's block is out (as c): a fresh one
    assert d.data_ptr() != a.data_ptr()
    assert pool.reserved_bytes() == 0


def test_too_small_or_other_dtype_blocks_are_not_used_and_keep_bounds_what_stays():
    pool = HostBufferPool(keep=2)
    small = pool.take(10, torch.float32, CPU)
    pool.give(small)
    assert pool.take(11, torch.float32, CPU).data_ptr() != small.data_ptr()
    assert pool.take(10, torch.bfloat16, CPU).dtype == torch.bfloat16
    for n in (10, 20, 30):
        pool.give(torch.empty(n))
    # the two largest stay
    assert sorted(b.numel() for b in pool.free[(torch.float32, CPU)]) == [20, 30]
    assert pool.reserved_bytes() == 50 * 4
    pool.give(torch.empty(40)[:5])  # a view gives back its whole block
    assert sorted(b.numel() for b in pool.free[(torch.float32, CPU)]) == [30, 40]


def test_keep_zero_keeps_nothing():
    pool = HostBufferPool(keep=0)
    pool.give(torch.empty(100))
    assert pool.reserved_bytes() == 0



@pytest.mark.parametrize("async_op", [False, True])
def test_gloo_exchanges_in_a_world_of_one_copy_through_without_pooled_buffers(world_of_one, async_op):
    # (with peers, the reduction's receive buffer comes from the pool and is back after the transfer:
    # tests/distributed/hsdp_checks.py::_collective_paths)
    pool = HostBufferPool()
    send = torch.arange(6, dtype=torch.float32)
    gathered, reduced = torch.empty(6), torch.empty(6)
    for work in (_collectives.all_gather(gathered, send, None, async_op, as_all_to_all=True),
                 _collectives.reduce_scatter(reduced, send, None, async_op, pool, as_all_to_all=True)):
        if async_op:
            work.wait()
    assert torch.equal(gathered, send) and torch.equal(reduced, send)
    assert pool.free == {}
