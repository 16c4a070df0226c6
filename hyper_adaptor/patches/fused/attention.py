"""Level 1 — megatron's local ``DotProductAttention`` computed by hyper_adaptor.ops.attention.

What stays with megatron's own forward (one notice per reason): packed sequences, attention bias,
context parallelism, sliding windows, softmax offsets ("off-by-one"/"learnable"), and mask types other
than causal / padding / arbitrary. Causal calls ignore the materialised mask megatron hands in (the
causal structure is the whole mask for GPT); padding/arbitrary masks are passed through.
"""

from __future__ import annotations

import functools

from hyper_adaptor.ops.attention import attention
from hyper_adaptor.ops.backend import notice
from hyper_adaptor.patch_manager import Patch

FEATURE = "flash_attn"
TARGET = "megatron.core.transformer.dot_product_attention.DotProductAttention.forward"


def effective_scale(module) -> float:
    """The scale megatron really applies to q k^T.

    ``softmax_scale`` (1/sqrt(hn) or the given value) is divided by layer_number when
    ``apply_query_key_layer_scaling`` is on, and the softmax multiplies that factor back in fp32.
    """
    coeff = getattr(module.scale_mask_softmax, "scale", None)
    return module.softmax_scale * (coeff if coeff is not None else 1.0)


def unsupported_call(module, mask_type, attention_bias, packed_seq_params, served_masks) -> str | None:
    """Why a ``DotProductAttention.forward`` call is outside what hyper_adaptor's attention computes
    (level 1's flash attention and level 2's context parallel alike), or None. ``served_masks``: the
    ``AttnMaskType`` values the caller serves."""
    if packed_seq_params is not None:
        return "packed sequences (THD)"
    if attention_bias is not None:
        return "an attention bias"
    if getattr(module.scale_mask_softmax, "window_size", None) is not None:
        return "sliding-window attention"
    if getattr(module, "softmax_offset", None) is not None:
        return f"softmax_type {module.config.softmax_type!r}"
    if mask_type not in served_masks:
        return f"mask type {mask_type.name} (served: {', '.join(m.name for m in served_masks)})"
    return None


def _wrap_forward(original):
    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core import tensor_parallel
        from megatron.core.transformer.enums import AttnMaskType

        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        served = (AttnMaskType.causal, AttnMaskType.padding, AttnMaskType.arbitrary, AttnMaskType.no_mask)
        reason = "context parallelism" if self.config.context_parallel_size != 1 else \
            unsupported_call(self, mask_type, attention_bias, packed_seq_params, served)
        if reason is not None:
            notice(FEATURE, "hyper_adaptor", reason, "megatron's DotProductAttention")
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        causal = mask_type == AttnMaskType.causal
        mask = None if causal or mask_type == AttnMaskType.no_mask else attention_mask
        p = self.attention_dropout.p if self.training else 0.0

        def run():
            return attention(query, key, value, causal=causal, mask=mask, scale=effective_scale(self),
                             dropout_p=p)

        if p > 0.0 and not self.config.sequence_parallel:
            # megatron draws attention dropout from the model-parallel RNG stream in this case
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return run()
        return run()

    return forward


def patches(args) -> list[Patch]:
    return [Patch(TARGET, _wrap_forward, "wrap", FEATURE)]
