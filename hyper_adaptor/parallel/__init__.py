"""Parallel engines (HSDP, tensor, context, expert and pipeline parallel, process groups): plain torch and
torch.distributed, no megatron import (docs/design.md). This package is the one import surface of the
library (docs/features/library.md)::

    from hyper_adaptor.parallel import fully_shard, Layout, PipelineStage, Schedule1F1B, ContextParallel

Every name is resolved on first use from its subpackage (the table below), so ``import hyper_adaptor.parallel``
stays free of torch.distributed and of the engines a caller does not use. ``hsdp`` itself (HyperParallel's
function) is reached as ``hyper_adaptor.parallel.hsdp.hsdp``: the attribute ``hsdp`` of this package is the
subpackage of that name, which Python binds here whenever it is imported.
"""

import importlib

_EXPORTS = {
    "hsdp": ("CPUOffloadPolicy", "DEFAULT_BUCKET_KB", "HSDPConfig", "HSDPModule", "HostBufferPool",
             "MixedPrecisionPolicy", "OffloadPolicy", "clip_grad_norm_", "fully_shard", "grad_sq_sum",
             "hsdp_sync_stream", "mark_stale"),
    "tensor": ("Layout", "DeviceMesh", "init_device_mesh", "get_current_mesh", "DTensor", "Shard", "Replicate",
               "Partial", "Placement", "distribute_tensor", "distribute_module", "init_parameters",
               "init_empty_weights", "init_on_device", "manual_seed", "ParallelStyle", "ColwiseParallel",
               "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
               "PrepareModuleInputOutput", "NoParallel", "parallelize_module", "shard_module", "ones", "zeros",
               "empty", "full", "rand", "randn", "is_partial", "reduce_partial"),
    "context": ("ALGORITHMS", "CPGroups", "ContextParallel", "Dropout", "RingStats", "build_cp_groups",
                "context_parallel_attention", "draw_seed", "ring_attention"),
    "expert": ("AllToAllDispatcher", "DROP_POLICIES", "PendingExchange", "Permutation", "all_to_all",
               "all_to_all_async", "capacity", "capacity_mask", "chunk_order", "exchange_counts",
               "experts_per_rank", "permute", "reorder", "send_splits", "unpermute", "ExpertParallel",
               "ExpertTensorParallel", "FeedForward", "GroupedExperts", "MoE", "HotExpertReplicas", "ReplicaPlan",
               "attach_replicas", "plan_replicas", "route_to_slots", "skewed_load_report", "zipf_bias",
               "CommComputeOverlap", "HookCoordinator", "HookRole", "OverlapStats", "measure_exposed_comm",
               "moe_forward_overlapped", "overlapped_moe_forward"),
    "pipeline": ("MetaStep", "MetaStepType", "StageLayout", "BatchDimSpec", "PipelineSchedule", "ScheduleGPipe",
                 "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBH1", "ScheduleZBV", "schedule_from_actions",
                 "PipelineStage", "execute", "PipelineRuntimeError", "build", "SCHEDULES",
                 "SPLIT_WEIGHT_SCHEDULES", "CHUNKED_SCHEDULES", "render", "ScheduleError", "validate_schedule",
                 "WeightGradQueue", "defer_weight_grads"),
    "process_group": ("destroy_process_group", "get_backend", "get_group_local_rank", "get_process_group_ranks",
                      "init_process_group", "mark_created_groups", "split_group"),
}

_WHERE = {name: package for package, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name):
    package = _WHERE.get(name)
    if package is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{package}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
