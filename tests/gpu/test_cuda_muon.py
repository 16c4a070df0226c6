"""Muon on a CUDA device, which no CPU test runs: ``ShardedMuon`` on CUDA against the CPU (fp32
Newton-Schulz at "highest" precision; bf16 iterations within bf16's reach), and the row-sharded (HSDP)
path's gather / scatter on a one-rank NCCL group against the whole matrix.

Skipped on machines without CUDA (CI has none); run by bench/gpu_session.sh.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hyper_adaptor.optim import ShardedMuon
from hyper_adaptor.testing import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SHAPES = [(384, 128), (128, 512), (256, 256)]


def _train(device, precision, steps=3, sharded=False):
    torch.manual_seed(0)
    # drawn on the host, then moved: CUDA's generator draws other numbers than the CPU's for a seed
    params = [torch.nn.Parameter(torch.randn(s).to(device)) for s in SHAPES]
    grads = [[torch.randn(s).to(device) for s in SHAPES] for _ in range(steps)]
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cuda", (1,))
        params = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in params]
        grads = [[distribute_tensor(g, mesh, [Shard(0)]) for g in step] for step in grads]
    opt = ShardedMuon(params, lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1, fp32_matmul_prec=precision)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g
        opt.step()
    return [(p.full_tensor() if sharded else p).detach().cpu() for p in params]


def test_cuda_equals_cpu_in_fp32():
    for got, want in zip(_train("cuda", "highest"), _train("cpu", "highest")):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_bf16_iterations_on_cuda_stay_near_fp32():
    for got, want in zip(_train("cuda", "medium"), _train("cuda", "highest")):
        assert (got - want).abs().max() < 2e-2


def test_row_sharded_path_over_nccl_equals_the_whole_matrix():
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        sharded = _train("cuda", "highest", sharded=True)
    finally:
        dist.destroy_process_group()
    for got, want in zip(sharded, _train("cuda", "highest")):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
