"""HSDP's CPU buffer pool (hyper_adaptor/parallel/hsdp/_bucket.py: HostBufferPool): a block given back
is handed out again to a request it fits, never while it is out, and at most ``keep`` blocks stay."""

import torch

from hyper_adaptor.parallel.hsdp._bucket import HostBufferPool

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
    b = pool.take(100, torch.float32, CPU)
    assert a.data_ptr() != b.data_ptr()
    pool.give(a)
    pool.give(a)  # twice: kept once
    c = pool.take(100, torch.float32, CPU)
    d = pool.take(100, torch.float32, CPU)
    assert c.data_ptr() == a.data_ptr() and d.data_ptr() not in (a.data_ptr(), b.data_ptr())


def test_too_small_or_other_dtype_blocks_are_not_used_and_keep_bounds_what_stays():
    pool = HostBufferPool(keep=2)
    small = pool.take(10, torch.float32, CPU)
    pool.give(small)
    assert pool.take(11, torch.float32, CPU).data_ptr() != small.data_ptr()
    assert pool.take(10, torch.bfloat16, CPU).dtype == torch.bfloat16
    for n in (10, 20, 30):
        pool.give(torch.empty(n))
    # the two largest stay (a view gives back its whole block)
    assert sorted(b.numel() for b in pool.free[(torch.float32, CPU)]) == [20, 30]
    assert pool.reserved_bytes() == 50 * 4
    pool.give(torch.empty(40)[:5])
    assert sorted(b.numel() for b in pool.free[(torch.float32, CPU)]) == [30, 40]


def test_keep_zero_keeps_nothing_and_the_live_pool_is_exported():
    from hyper_adaptor.parallel.hsdp import _bucket, host_buffer_pool

    assert host_buffer_pool() is _bucket.POOL
    pool = HostBufferPool(keep=0)
    pool.give(torch.empty(100))
    assert pool.reserved_bytes() == 0
