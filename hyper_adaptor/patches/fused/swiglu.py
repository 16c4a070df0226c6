"""Level 1: megatron's ``bias_swiglu_impl`` (called by its MLP and shared experts when
``config.bias_activation_fusion`` is on) runs :func:`hyper_adaptor.ops.swiglu.bias_swiglu`.

The patch manager also rebinds the name in modules that imported it by value
(``megatron.core.transformer.mlp``, ``megatron.core.transformer.moe.shared_experts``).
"""

from __future__ import annotations

from hyper_adaptor.patch_manager import Patch
from hyper_adaptor.patches.megatron_releases import BIAS_SWIGLU

FEATURE = "fused_swiglu"
TARGET = BIAS_SWIGLU


def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False, clamp_value=None):
    """Same signature and result shape as megatron-core's ``bias_swiglu_impl`` (bias may be None);
    ``clamp_value`` exists from megatron-core main on (megatron_releases.SEAMS) and is None before."""
    from hyper_adaptor.ops.swiglu import bias_swiglu

    if clamp_value is not None:  # megatron's clamped form: gate half capped above, linear half both ways
        import torch.nn.functional as F

        biased = input if bias is None else input + bias
        gate, linear = biased.float().chunk(2, dim=-1)
        out = F.silu(gate.clamp(max=clamp_value)) * linear.clamp(min=-clamp_value, max=clamp_value)
        return out.to(biased.dtype)
    return bias_swiglu(input, bias, fp8_input_store=bool(fp8_input_store),
                       cpu_offload_input=bool(cpu_offload_input))


def patches(args) -> list[Patch]:
    return [Patch(TARGET, bias_swiglu_impl, "replace", FEATURE)]
