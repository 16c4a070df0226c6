"""The library's tensor parallel on a CUDA device, which no CPU test reaches: ``manual_seed`` seeding
torch's DTensor RNG tracker (cuda-like devices only), and the exact-dropout rule on CUDA, where
``F.dropout`` is a fused kernel and torch's tracker draws from its own stream. One rank on a one-rank
NCCL group (NCCL refuses two ranks on one GPU): the placements, DTensor dispatch and the tracker are
the multi-rank code paths; the sharding itself is trivial.

Skipped on machines without CUDA (CI has none); run by bench/gpu_session.sh.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyper_adaptor.testing import free_port
from tests.distributed import tensor_checks as tc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def mesh():
    from hyper_adaptor.parallel.tensor import init_device_mesh

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    try:
        yield init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_manual_seed_seeds_torch_rng_tracker_on_cuda(mesh):
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import _random

    from hyper_adaptor.parallel.tensor import Replicate, _torch_private, manual_seed

    assert _torch_private.rng_tracker_supported(mesh)

    def draw(seed):
        manual_seed(seed, mesh)
        torch.rand(16, device="cuda")  # the default generator moves on; the tracker's stream does not
        return dt.rand(64, 64, device_mesh=mesh, placements=[Replicate()]).full_tensor()

    first = draw(1234)
    assert _random._rng_tracker is not None
    assert torch.equal(draw(1234), first)        # the tracker was re-seeded: the same numbers again
    assert not torch.equal(draw(99), first)      # and by the seed given


def test_the_mask_kernel_matters_on_cuda():
    """Why ``dropout`` draws its mask through F.dropout: on CUDA a bernoulli_ draw after the same seed
    gives another mask than F.dropout's fused kernel (on the CPU they are the same draw)."""
    torch.manual_seed(7)
    fused = F.dropout(torch.ones(4, 64, 32, device="cuda"), 0.3, True) != 0
    torch.manual_seed(7)
    drawn = torch.empty(4, 64, 32, device="cuda").bernoulli_(0.7) != 0
    print(f"\nCUDA: bernoulli_ mask equal to F.dropout's: {torch.equal(fused, drawn)}")
    assert not torch.equal(fused, drawn)


def test_dropout_on_dtensors_draws_one_process_mask_on_cuda(mesh):
    from hyper_adaptor.parallel.tensor import Replicate, Shard, distribute_tensor, dropout, manual_seed

    x = torch.randn(4, 64, 32, device="cuda")
    torch.manual_seed(7)
    ref = F.dropout(x, 0.3, True)
    for placement in (Shard(1), Replicate()):
        manual_seed(7, mesh)
        got = dropout(distribute_tensor(x, mesh, [placement]), 0.3, True).full_tensor()
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=0, msg=f"{placement}")


def _train(model, mesh=None):
    tokens_fn = tc.batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    from hyper_adaptor.parallel.tensor import manual_seed

    manual_seed(tc.SEED, mesh)
    losses = []
    for step in range(tc.STEPS):
        opt.zero_grad()
        tokens = tokens_fn(step).cuda()
        logits = tc.full(model(tokens[:, :-1]))
        loss = F.cross_entropy(logits.reshape(-1, tc.VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: tc.full(p).detach().float().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_parallelized_model_with_dropout_equals_one_process_on_cuda(mesh, sp):
    from hyper_adaptor.parallel.tensor import parallelize_module

    torch.backends.cuda.matmul.allow_tf32 = False
    ref_loss, ref_params = _train(tc.make_model().cuda())
    got_loss, got_params = _train(parallelize_module(tc.make_model().cuda(), mesh, tc.tp_plan(sp)), mesh)
    assert got_loss == pytest.approx(ref_loss, abs=1e-5), (got_loss, ref_loss)
    for n, p in ref_params.items():
        torch.testing.assert_close(got_params[n], p, rtol=0, atol=1e-5, msg=n)
