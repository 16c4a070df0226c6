"""Level 1 — megatron's RoPE entry point served by hyper_adaptor.ops.rope for the [s, b, n, d] layout.

Packed sequences (``cu_seqlens`` given, the "thd" layout) stay with megatron's own code.
"""

from __future__ import annotations

import functools

from hyper_adaptor.ops.rope import apply_rotary
from hyper_adaptor.patch_manager import Patch

FEATURE = "fused_rope"
TARGET = "megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb"


def _wrap_apply_rotary_pos_emb(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                             mla_rotary_interleaved=False):
        if cu_seqlens is not None:
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group,
                            mla_rotary_interleaved=mla_rotary_interleaved)
        if mla_rotary_interleaved is None:  # megatron's own default for a None flag
            mla_rotary_interleaved = config.multi_latent_attention
        return apply_rotary(t, freqs, interleaved=bool(config.rotary_interleaved),
                            mla_interleaved=bool(mla_rotary_interleaved), mscale=mscale)

    return apply_rotary_pos_emb


def patches(args) -> list[Patch]:
    return [Patch(TARGET, _wrap_apply_rotary_pos_emb, "wrap", FEATURE)]
