"""Level 2 — megatron's ``--optimizer-cpu-offload`` / ``--optimizer-offload-fraction`` served on every
device (docs/features/memory.md): the optimizer's state and fp32 master weights on the host, stepped
there by the engine ``hyper_adaptor.memory.OffloadOptimizer``. ``adjust`` changes what megatron's
``validate_args`` sees, ``validate`` refuses what the offload cannot serve; the seams are in
``hyper_adaptor/patches/memory/optimizer.py`` (and the modules it names)."""

from __future__ import annotations

import torch

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag, asked, hide_from_megatron, switch

# megatron's precision-aware optimizer settings; with offload they must be the fp32 defaults (the
# engine keeps fp32 masters and moments on the host)
_PRECISION_DTYPES = {"main_grads_dtype": "--main-grads-dtype", "main_params_dtype": "--main-params-dtype",
                     "exp_avg_dtype": "--exp-avg-dtype", "exp_avg_sq_dtype": "--exp-avg-sq-dtype"}


class OptimizerOffload(Feature):
    name = "optimizer_offload"
    level = 2
    summary = "optimizer state and fp32 master weights on the host, stepped there (--optimizer-cpu-offload)"
    flags = (
        Flag("--optimizer-cpu-offload", "megatron's; served by hyper_adaptor's host optimizer", owner="megatron"),
        Flag("--optimizer-offload-fraction", "megatron's: the share of parameter elements whose optimizer state "
             "lives on the host", kwargs=dict(type=float, default=1.0), owner="megatron"),
    )

    def requested(self, args) -> bool:
        # read through ``asked``: between adjust and megatron's check the flag is hidden from megatron
        return bool(asked(args, "optimizer_cpu_offload"))

    def adjust(self, args) -> list[str]:
        """Megatron's ``validate_args`` asserts ``--use-precision-aware-optimizer`` with
        ``--optimizer-cpu-offload``. That flag is how megatron's own CUDA ``HybridDeviceOptimizer`` is fed,
        and it needs TransformerEngine and the distributed optimizer; this engine needs neither. So
        ``--optimizer-cpu-offload`` is hidden from megatron's check (put back right after, so the
        ``OptimizerConfig`` megatron builds carries it to the factory seam), and a
        ``--use-precision-aware-optimizer`` given along (as megatron's documentation asks) is switched off
        with a notice: a user's megatron command line keeps working unchanged, and a command line without
        it works too. Requiring the flag instead would tie the offload to the distributed optimizer and TE."""
        notices = [hide_from_megatron(args, "optimizer_cpu_offload",
                                      "megatron asserts --use-precision-aware-optimizer with it; served by "
                                      "hyper_adaptor's host optimizer")]
        if getattr(args, "use_precision_aware_optimizer", False) and _precision_dtypes_are_fp32(args) \
                and not serves_precision_aware(args):
            notices.append(switch(args, "use_precision_aware_optimizer", False,
                                  "--optimizer-cpu-offload is served by hyper_adaptor's host optimizer, which keeps "
                                  "fp32 master weights and moments itself"))
        if _half(args) and getattr(args, "use_distributed_optimizer", False) \
                and not getattr(args, "use_precision_aware_optimizer", False):
            notices.append("--optimizer-cpu-offload --use-distributed-optimizer with --bf16 / --fp16: megatron's fp32 "
                           "main shards stay on the device (4 bytes per element of the rank's shard); "
                           "--use-precision-aware-optimizer keeps them on the host only (megatron's own offload path)")
        return notices

    def validate(self, args) -> None:
        """Combinations the offload cannot serve, as errors naming the flags (checks only)."""
        fraction = getattr(args, "optimizer_offload_fraction", 1.0)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise FeatureConfigError(f"--optimizer-offload-fraction must be in [0, 1] (the share of parameter elements "
                                     f"whose optimizer state lives on the host); got {fraction!r}")
        name = getattr(args, "optimizer", "adam")
        if name not in ("adam", "sgd"):
            raise FeatureConfigError(f"--optimizer-cpu-offload serves --optimizer adam or sgd (as megatron's does); "
                                     f"got --optimizer {name}")
        if not _precision_dtypes_are_fp32(args):
            given = " ".join(f"{flag} {_dtype_name(getattr(args, dest))}" for dest, flag in _PRECISION_DTYPES.items()
                             if not _is_fp32(getattr(args, dest, None)))
            raise FeatureConfigError(f"--optimizer-cpu-offload keeps fp32 master weights and moments on the host; "
                                     f"{given} (precision-aware optimizer dtypes) cannot be served with it")
        if _half(args) and getattr(args, "qk_clip", False) \
                and not getattr(args, "use_distributed_optimizer", False):
            raise FeatureConfigError("--optimizer-cpu-offload with --bf16 / --fp16 keeps the fp32 main copies of the "
                                     "offloaded parameters on the host only; --qk-clip rewrites those copies on the "
                                     "device in place (drop one of the two, or add --use-distributed-optimizer)")
        for dest, flag in (("use_megatron_fsdp", "--use-megatron-fsdp"), ("use_torch_fsdp2", "--use-torch-fsdp2"),
                           ("use_layer_wise_distributed_optimizer", "--use-layer-wise-distributed-optimizer"),
                           ("optimizer_cuda_graph", "--optimizer-cuda-graph")):
            if getattr(args, dest, False):
                raise FeatureConfigError(f"--optimizer-cpu-offload cannot be combined with {flag} (served with "
                                         f"megatron's DDP, --use-distributed-optimizer and --use-hsdp)")

    def patches(self, args):
        from hyper_adaptor.patches.memory import optimizer

        return optimizer.patches(args)


def serves_precision_aware(args) -> bool:
    """Whether ``--use-precision-aware-optimizer`` stays on with ``--optimizer-cpu-offload``: megatron's own
    path for it (its distributed optimizer over a CPU-offload optimizer, which hyper_adaptor replaces) is
    the one where no fp32 main copies sit beside half-precision parameters, so it is kept where megatron
    can take it — the distributed optimizer, ``--bf16`` / ``--fp16``, Adam (megatron's precision-aware
    optimizer is Adam only), megatron's own DDP (not ``--use-hsdp``). Elsewhere it would only add
    megatron's requirements (the distributed optimizer, Adam) to a case the other path serves."""
    return bool(getattr(args, "use_distributed_optimizer", False)
                and _half(args)
                and getattr(args, "optimizer", "adam") == "adam"
                and not getattr(args, "use_hsdp", False))


def _half(args) -> bool:
    return bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))


def _is_fp32(value) -> bool:
    return value in (None, "fp32", torch.float32)


def _dtype_name(value) -> str:
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    return names.get(value, str(value))


def _precision_dtypes_are_fp32(args) -> bool:
    return all(_is_fp32(getattr(args, dest, None)) for dest in _PRECISION_DTYPES)


