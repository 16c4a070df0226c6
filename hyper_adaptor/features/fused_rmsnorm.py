"""Level 1 — fused RMSNorm in place of the local spec's torch norm (hyper_adaptor/ops/rms_norm.py)."""

from __future__ import annotations

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag
from hyper_adaptor.features.fused_common import require_local_impl


class FusedRMSNorm(Feature):
    name = "fused_rmsnorm"
    level = 1
    summary = "RMSNorm: torch_npu npu_rms_norm / fused torch path / eager"
    flags = (Flag("--use-fused-rmsnorm", "Fused RMSNorm kernel for --normalization RMSNorm (level 1)."),)

    def validate(self, args) -> None:
        norm = getattr(args, "normalization", "RMSNorm")
        if norm != "RMSNorm":
            raise FeatureConfigError(f"--use-fused-rmsnorm needs --normalization RMSNorm, got --normalization {norm}")
        require_local_impl(args, "--use-fused-rmsnorm")

    def patches(self, args):
        from hyper_adaptor.patches.fused import rms_norm

        return rms_norm.patches(args)
