"""The patches ``--use-hsdp`` registers."""

from __future__ import annotations

from hyper_adaptor.patch_manager import Patch

FEATURE = "hsdp"
OPTIMIZER = "megatron.core.optimizer.optimizer"


def patches(args) -> list[Patch]:
    from hyper_adaptor.features.hsdp import hsdp_kwargs
    from hyper_adaptor.patches.hsdp.checkpoint import hsdp_optimizer_load, hsdp_param_id_map
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
