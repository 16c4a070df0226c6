"""Level 1 — which backend the fused ops try first (npu / fast / eager), for testing and debugging."""

from __future__ import annotations

from hyper_adaptor import platform
from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag


class FusedBackend(Feature):
    name = "fused_backend"
    level = 1
    summary = "force the first backend every fused op tries (default: npu on NPU, else fast)"
    flags = (
        Flag(
            "--fused-backend",
            "First backend of every fused op: auto (npu on an NPU, else fast), npu, fast or eager. "
            "Also HYPER_ADAPTOR_OPS_BACKEND. A backend that cannot serve a call falls back with one notice.",
            {"choices": ("auto", "npu", "fast", "eager"), "default": "auto"},
        ),
    )

    def requested(self, args) -> bool:
        return getattr(args, "fused_backend", "auto") != "auto"

    def validate(self, args) -> None:
        device = platform.device_type()
        if args.fused_backend == "npu" and device != "npu":
            # every call would fall back, one notice per op: a forced choice that forces nothing
            raise FeatureConfigError(f"--fused-backend npu: this process runs on {device}, which has no torch_npu "
                                     f"kernels; use auto, fast or eager")

    def on_applied(self, args) -> None:
        from hyper_adaptor.ops import backend

        backend.force_backend(args.fused_backend)
