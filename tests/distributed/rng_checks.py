"""Checks run inside a TP=2 world: the tensor-parallel RNG tracker on the emulated device."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gathered_over_tp(tensor):
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


def _dropout_masks(seed):
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.model_parallel_cuda_manual_seed(seed)
    tracker = mrandom.get_cuda_rng_tracker()
    ones = torch.ones(256, device="cuda")
    before = torch.get_rng_state()
    with tracker.fork():
        inside = torch.nn.functional.dropout(ones, p=0.5)
    restored = torch.equal(torch.get_rng_state(), before)
    outside = torch.nn.functional.dropout(ones, p=0.5)
    inside_all, outside_all = _gathered_over_tp(inside), _gathered_over_tp(outside)
    return {
        "inside_differs_across_tp": not torch.equal(inside_all[0], inside_all[1]),
        "outside_same_across_tp": torch.equal(outside_all[0], outside_all[1]),
        "default_stream_restored": restored,
    }


def tracker_semantics(rank: int, world_size: int) -> dict:
    import hyper_adaptor.megatron_adaptor as adaptor

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    patched = _dropout_masks(1234)
    # The same with megatron's own _set_cuda_rng_state put back: on a CPU build it queues the state
    # change lazily and never applies it, so the fork does nothing.
    name = "_set_cuda_rng_state"
    ours = getattr(mrandom, name)
    setattr(mrandom, name, adaptor.ADAPTOR.manager.original(f"{mrandom.__name__}.{name}"))
    try:
        unpatched = _dropout_masks(1234)
    finally:
        setattr(mrandom, name, ours)
    ps.destroy_model_parallel()
    return {"patched": patched, "unpatched": unpatched}
