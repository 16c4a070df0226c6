"""Level 1 — fused SwiGLU (with Megatron's fused-bias variant) in the MLP (hyper_adaptor/ops/swiglu.py)."""

from __future__ import annotations

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag
from hyper_adaptor.features.fused_common import require_local_impl


class FusedSwiGLU(Feature):
    name = "fused_swiglu"
    level = 1
    summary = "SwiGLU (+bias): torch_npu npu_swiglu / fused autograd / eager"
    flags = (Flag("--use-fused-swiglu", "Fused SwiGLU kernel in the MLP; needs --swiglu (level 1)."),)

    def validate(self, args) -> None:
        if not getattr(args, "swiglu", False):
            raise FeatureConfigError("--use-fused-swiglu needs --swiglu")
        if not getattr(args, "bias_swiglu_fusion", True):
            raise FeatureConfigError(
                "--use-fused-swiglu and --no-bias-swiglu-fusion cannot be combined: megatron calls the "
                "fused SwiGLU only when its bias-SwiGLU fusion is on"
            )
        require_local_impl(args, "--use-fused-swiglu")

    def patches(self, args):
        from hyper_adaptor.patches.fused import swiglu

        return swiglu.patches(args)
