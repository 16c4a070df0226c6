"""Level 0 — compatibility: megatron-core and megatron.training run unchanged on npu, cuda or cpu.

Applied at import time of ``hyper_adaptor.megatron_adaptor`` (see there); this class is how the
feature shows up in flags, validation and ``describe``.
"""

from __future__ import annotations

from hyper_adaptor import platform
from hyper_adaptor.features.base import Feature, Flag


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

    def patches(self, args):
        from hyper_adaptor.patches.compat import megatron_core, megatron_training
        from hyper_adaptor.platform import cpu

        dev = platform.device_type()
        result = cpu.torch_patches() if dev == "cpu" else []
        return result + megatron_core.patches(dev) + megatron_training.patches(dev)
