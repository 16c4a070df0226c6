"""Rank code for test_nccl_request.py: a world set up the way code written for CUDA sets it up."""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp2_from_nccl_request(rank, world_size, unpatched=False):
    """``init_process_group(backend="nccl")``, then megatron's initialize_model_parallel(tp=2) and one
    all-reduce over its TP group. ``unpatched``: the same call on torch's own init_process_group."""
    from hyper_adaptor.megatron_adaptor import ADAPTOR

    init = ADAPTOR.manager.original("torch.distributed.init_process_group") if unpatched else dist.init_process_group
    init(backend="nccl", rank=rank, world_size=world_size)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    # a group megatron itself asks for with "nccl" (its PP communication backend)
    explicit = dist.new_group(ranks=list(range(world_size)), backend="nccl")
    value = torch.tensor([float(rank + 1)], device="cuda")
    dist.all_reduce(value, group=ps.get_tensor_model_parallel_group())
    dist.all_reduce(value, group=explicit)
    result = {
        "backend": dist.get_backend(),
        "tp_backend": dist.get_backend(ps.get_tensor_model_parallel_group()),
        "explicit_backend": dist.get_backend(explicit),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "sum": value.item(),
    }
    ps.destroy_model_parallel()
    return result


def megatron_pp_backend_nccl(rank, world_size):
    """megatron's own group creation asking for "nccl" (``pipeline_model_parallel_comm_backend``)."""
    dist.init_process_group(backend="nccl", rank=rank, world_size=world_size)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(pipeline_model_parallel_size=2, pipeline_model_parallel_comm_backend="nccl")
    group = ps.get_pipeline_model_parallel_group()
    value = torch.ones(1)
    dist.all_reduce(value, group=group)
    result = {"pp_backend": dist.get_backend(group), "sum": value.item()}
    ps.destroy_model_parallel()
    return result
