"""Level 1: megatron's ``bias_swiglu_impl`` (called by its MLP and shared experts when
``config.bias_activation_fusion`` is on) runs :func:`hyper_adaptor.ops.swiglu.bias_swiglu`.

The patch manager also rebinds the name in modules that imported it by value
(``megatron.core.transformer.mlp``, ``megatron.core.transformer.moe.shared_experts``).
"""

from __future__ import annotations

from hyper_adaptor.patch_manager import Patch

FEATURE = "fused_swiglu"
TARGET = "megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl"


def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """Same signature and result shape as megatron-core's ``bias_swiglu_impl`` (bias may be None)."""
    from hyper_adaptor.ops.swiglu import bias_swiglu

    return bias_swiglu(input, bias, fp8_input_store=bool(fp8_input_store),
                       cpu_offload_input=bool(cpu_offload_input))


def patches(args) -> list[Patch]:
    return [Patch(TARGET, bias_swiglu_impl, "replace", FEATURE)]
