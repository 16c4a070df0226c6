"""The patches ``--use-hsdp`` registers."""

from __future__ import annotations

import torch

from hyper_adaptor.patch_manager import Patch

FEATURE = "hsdp"
OPTIMIZER = "megatron.core.optimizer.optimizer"
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
__all__ = ["REDUCE_DTYPES", "hsdp_kwargs", "patches"]


def hsdp_kwargs(args) -> dict:
    """The engine's arguments for these Megatron flags."""
    reduce = args.hsdp_reduce_dtype
    return {
        "optimizer_level": args.hsdp_optimizer_level,
        "shard_size": args.hsdp_shard_size,
        "threshold": args.hsdp_threshold_kb,
        "comm_async": bool(args.hsdp_comm_async),
        "comm_fusion": args.hsdp_bucket_size_kb != 0,
        # 0: no fusion and no fused collective across units either (one collective per parameter)
        "bucket_size": args.hsdp_bucket_size_kb,
        "reduce_dtype": REDUCE_DTYPES[reduce] if reduce else None,
        "enable_grad_accumulation": True,
    }


def patches(args) -> list[Patch]:
    from hyper_adaptor.patches.hsdp.checkpoint import hsdp_optimizer_load, hsdp_param_id_map, localized_state_dict
    from hyper_adaptor.patches.hsdp.data_parallel import make_wrapper_class
    from hyper_adaptor.patches.hsdp.grad_norm import hsdp_grad_norm
    from hyper_adaptor.patches.hsdp.optimizer import found_inf_over_data_parallel, mark_shards_stale

    wrapper = make_wrapper_class(hsdp_kwargs(args))
    return [
        # only the name _ddp_wrap reads; megatron.core's DistributedDataParallel stays as it is
        Patch("megatron.training.models.dist_utils.DistributedDataParallel", wrapper, "replace", FEATURE,
              rebind_in=()),
        Patch("megatron.core.optimizer.clip_grads.get_grad_norm_fp32", hsdp_grad_norm, "wrap", FEATURE),
        # torch_dist checkpoints of the DTensor shards (see checkpoint.py)
        Patch("megatron.training.checkpointing.generate_state_dict", localized_state_dict, "wrap", FEATURE),
        Patch("megatron.core.dist_checkpointing.optimizer.get_param_id_to_sharded_param_map", hsdp_param_id_map,
              "wrap", FEATURE),
        Patch(f"{OPTIMIZER}.FP32Optimizer.load_state_dict", hsdp_optimizer_load, "wrap", FEATURE),
        Patch(f"{OPTIMIZER}.Float16OptimizerWithFloat16Params.load_state_dict", hsdp_optimizer_load, "wrap", FEATURE),
        # bf16: the shards are written from fp32 main copies after the step
        Patch(f"{OPTIMIZER}.Float16OptimizerWithFloat16Params._copy_main_params_to_model_params", mark_shards_stale,
              "wrap", FEATURE),
        # loss scaling: an overflow in one rank's gradient shard skips the step on every rank
        Patch(f"{OPTIMIZER}.MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan",
              found_inf_over_data_parallel, "wrap", FEATURE),
    ]
