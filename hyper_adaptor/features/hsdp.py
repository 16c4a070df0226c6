"""Level 2 — HSDP as Megatron's data-parallel engine (``--use-hsdp``).

Replaces megatron's DDP wrapper and optimizer sharding: megatron's data-parallel group (with
context parallel) is the HSDP group, so it composes with TP and PP; under expert parallelism the
experts are sharded over megatron's expert-data-parallel group. Engine:
hyper_adaptor/parallel/hsdp; megatron seam: hyper_adaptor/patches/hsdp.
"""

from __future__ import annotations

import math

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag, refuse_combined, switch
from hyper_adaptor.parallel.hsdp import DEFAULT_BUCKET_KB
from hyper_adaptor.patches.hsdp.patches import REDUCE_DTYPES


class HSDP(Feature):
    name = "hsdp"
    level = 2
    summary = "hybrid sharded data parallel (ZeRO level 1/2/3 over shard groups) in place of megatron DDP"
    flags = (
        Flag("--use-hsdp", "HSDP in place of megatron's DDP wrapper and distributed optimizer"),
        Flag("--hsdp-optimizer-level", "level1: shard optimizer state; level2: + gradients; level3: + parameters",
             {"choices": ("level1", "level2", "level3"), "default": "level2"}),
        Flag("--hsdp-shard-size",
             "ranks per shard group (-1: the whole data-parallel group); groups beyond it replicate; "
             "expert parameters under expert parallelism: at most their expert data-parallel group",
             {"type": int, "default": -1}),
        Flag("--hsdp-threshold-kb", "parameters smaller than this (KB) are kept whole on every rank",
             {"type": float, "default": 64.0}),
        Flag("--hsdp-bucket-size-kb", "communication bucket (KB): the most one collective's buffer holds "
             "(default 25600, torch DDP's 25 MB); -1: one per module and no limit, 0: one per parameter",
             {"type": float, "default": float(DEFAULT_BUCKET_KB)}),
        Flag("--hsdp-comm-async", "overlap gradient reduction with the rest of backward"),
        Flag("--hsdp-reduce-dtype", "dtype of the gradient reduction (default: the parameters' dtype)",
             {"choices": tuple(REDUCE_DTYPES), "default": None}),
    )

    def requested(self, args) -> bool:
        return bool(getattr(args, "use_hsdp", False))

    def adjust(self, args) -> list[str]:
        notices = []
        if getattr(args, "fp16", False) and args.hsdp_reduce_dtype is None:
            # fp16 gradients carry the loss scale: HSDP sums them over the shard group before it
            # averages, and an fp16 sum overflows where megatron (dividing first) does not — seen as
            # steps skipped only under --use-hsdp. Reduce in fp32 unless asked otherwise.
            notices.append(switch(args, "hsdp_reduce_dtype", "fp32",
                                  "--use-hsdp with --fp16 reduces gradients in fp32; set it to fp16 to override"))
        if getattr(args, "gradient_accumulation_fusion", False):
            # megatron's fused wgrad writes into param.main_grad, which HSDP's gathered copies do
            # not carry: the gradient goes to .grad and is reduced by HSDP's hooks instead.
            notices.append(switch(args, "gradient_accumulation_fusion", False,
                                  "--use-hsdp reduces gradients from .grad"))
        return notices

    def validate(self, args) -> None:
        conflicts = {
            "use_distributed_optimizer": "--use-distributed-optimizer",
            "use_megatron_fsdp": "--use-megatron-fsdp",
            "use_torch_fsdp2": "--use-torch-fsdp2",
            "overlap_grad_reduce": "--overlap-grad-reduce (use --hsdp-comm-async)",
            "overlap_param_gather": "--overlap-param-gather",
            "data_parallel_random_init": "--data-parallel-random-init",
        }
        refuse_combined(args, "--use-hsdp", conflicts)
        fmt = getattr(args, "ckpt_format", "torch_dist")
        if (getattr(args, "save", None) or getattr(args, "load", None)) and fmt != "torch_dist":
            # HSDP's shards are written as megatron torch_dist entries at their global offsets
            # (hyper_adaptor/patches/hsdp/checkpoint.py); the per-rank torch formats would keep
            # only data-parallel rank 0's shard.
            raise FeatureConfigError(
                f"--use-hsdp checkpoints need --ckpt-format torch_dist (the default); got --ckpt-format {fmt}"
            )
        shard = args.hsdp_shard_size
        if shard != -1 and shard < 1:
            raise FeatureConfigError(f"--hsdp-shard-size must be -1 (the whole data-parallel group) or a number of "
                                     f"ranks >= 1; got {shard}")
        dp = _data_parallel_size(args)
        if shard != -1 and dp and dp % shard:
            # only where the world size is known (a launched run; describe has none)
            raise FeatureConfigError(
                f"--hsdp-shard-size {shard} must be -1 or divide the data-parallel size {dp} "
                f"(world {args.world_size} / TP x PP x CP)"
            )
        edp = _expert_data_parallel_size(args)
        if shard != -1 and edp and shard < edp and edp % shard:
            # expert parameters are sharded over the expert-data-parallel group (experts of one EP
            # rank), which is smaller than the data-parallel group under expert parallelism; a shard
            # size at least that group's is the whole group
            raise FeatureConfigError(
                f"--hsdp-shard-size {shard} must be -1, at least, or divide the expert data-parallel size {edp} "
                f"(world {args.world_size} / expert TP x EP x PP with --expert-model-parallel-size "
                f"{getattr(args, 'expert_model_parallel_size', 1)})"
            )
        threshold = args.hsdp_threshold_kb
        if not math.isfinite(threshold) or threshold < 0:
            raise FeatureConfigError(f"--hsdp-threshold-kb must be a finite number >= 0; got {threshold}")
        bucket = args.hsdp_bucket_size_kb
        if not math.isfinite(bucket) or (bucket < 0 and bucket != -1):
            raise FeatureConfigError(f"--hsdp-bucket-size-kb must be -1, 0 or a finite number > 0; got {bucket}")

    def patches(self, args):
        from hyper_adaptor.patches.hsdp import patches

        return patches.patches(args)


def _data_parallel_size(args) -> int | None:
    world = getattr(args, "world_size", None)
    if not world:
        return None
    model = (
        getattr(args, "tensor_model_parallel_size", 1) * getattr(args, "pipeline_model_parallel_size", 1)
        * (getattr(args, "context_parallel_size", 1) or 1)
    )
    return world // model if model and world % model == 0 else None


def _expert_data_parallel_size(args) -> int | None:
    """megatron's expert-data-parallel size: world / (expert TP x EP x PP), where the world is known."""
    world = getattr(args, "world_size", None)
    if not world:
        return None
    etp = getattr(args, "expert_tensor_parallel_size", None) or getattr(args, "tensor_model_parallel_size", 1)
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    model = etp * ep * getattr(args, "pipeline_model_parallel_size", 1)
    return world // model if model and world % model == 0 else None
