"""Gradient accumulation fusion without apex: Megatron's ``gradient_accumulation_fusion`` on any device.

megatron-core's tensor_parallel/layers.py imports apex's ``fused_weight_gradient_mlp_cuda`` at module
import, and only when that succeeds sets ``_grad_accum_fusion_available``; Column/RowParallelLinear
refuse ``gradient_accumulation_fusion=True`` otherwise, and the linear backward looks the module up as
a global at call time. This feature provides that global (``hyper_adaptor.ops.wgrad_accum.KERNELS``)
and marks the fusion available. Where apex's real module is in place, megatron uses it and this
feature patches nothing.

Not covered: ``megatron.core.utils.drain_embedding_wgrad_compute`` (deferred embedding wgrad) imports
the apex module inside the function, which no attribute patch reaches.
"""

from __future__ import annotations

from hyper_adaptor.ops.wgrad_accum import KERNELS
from hyper_adaptor.patch_manager import Patch

FEATURE = "grad_accum_fusion"
LAYERS = "megatron.core.tensor_parallel.layers"
APEX_MODULE = "fused_weight_gradient_mlp_cuda"


def apex_in_use() -> bool:
    """True when megatron's layers module bound apex's real extension at import."""
    import megatron.core.tensor_parallel.layers as layers

    return getattr(layers, APEX_MODULE, None) is not None and getattr(layers, APEX_MODULE) is not KERNELS


def patches(args=None) -> list[Patch]:
    if apex_in_use():
        return []
    return [
        Patch(f"{LAYERS}.{APEX_MODULE}", KERNELS, "provide", FEATURE, rebind_in=()),
        Patch(f"{LAYERS}._grad_accum_fusion_available", True, "replace", FEATURE, rebind_in=()),
    ]
