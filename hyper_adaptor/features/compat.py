"""Level 0 — compatibility: megatron-core and megatron.training run unchanged on npu, cuda or cpu.

Applied at import time of ``hyper_adaptor.megatron_adaptor`` (see there); this class is how the
feature shows up in flags, validation and ``describe``.
"""

from __future__ import annotations

from hyper_adaptor import platform
from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag


class Compat(Feature):
    name = "compat"
    level = 0
    always_on = True
    summary = "device mapping, RNG, streams, missing optional deps, Python shims, distributed backend"
    flags = (
        Flag(
            "--device-type",
            "Accelerator to train on: auto picks npu, then cuda, then cpu (also HYPER_ADAPTOR_DEVICE).",
            {"choices": ("auto",) + platform.DEVICE_TYPES, "default": "auto"},
        ),
    )

    def adjust(self, args) -> list[str]:
        from hyper_adaptor.patches.compat import arguments

        return arguments.switch_unworkable_defaults(args, platform.device_type())

    def validate(self, args) -> None:
        from hyper_adaptor.patches.compat import megatron_training, moe_dispatchers

        problem = megatron_training.dataset_helpers_problem()
        if problem:
            raise FeatureConfigError(problem)
        # megatron's flex MoE dispatcher: its CUDA backend, before megatron builds a model without it
        problem = moe_dispatchers.flex_backend_problem(args, platform.device_type())
        if problem:
            raise FeatureConfigError(problem)

    def patches(self, args):
        """The level-0 patches applied after megatron is importable (the import shims come first:
        ``import_patches``)."""
        from hyper_adaptor.patches.compat import (
            backends,
            fusion_switches,
            gloo_collectives,
            megatron_core,
            megatron_training,
            te_spec,
            torch_cpu,
        )
        from hyper_adaptor.patches.context import library as context_library

        dev = platform.device_type()
        result = torch_cpu.torch_patches() if dev == "cpu" else []
        if dev not in ("cpu", "cuda"):  # megatron hands a2a split sizes as tensors off CUDA (gloo_collectives.py)
            result += gloo_collectives.split_size_patches()
        return (
            result + backends.patches(dev) + fusion_switches.patches() + megatron_core.patches(dev)
            + megatron_training.patches(dev) + te_spec.patches() + context_library.patches()
        )

    def import_patches(self) -> list:
        """What must be in place before megatron is imported at all."""
        from hyper_adaptor.patches.compat import imports

        return imports.patches()

