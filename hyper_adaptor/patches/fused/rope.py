"""Level 1 — megatron's RoPE entry point served by hyper_adaptor.ops.rope for the [s, b, n, d] layout.

Packed sequences (``cu_seqlens`` given, the "thd" layout) stay with megatron's own code.
"""

from __future__ import annotations

import functools

from hyper_adaptor.ops.rope import apply_rotary
from hyper_adaptor.patch_manager import Patch
from hyper_adaptor.patches.megatron_releases import APPLY_ROPE

FEATURE = "fused_rope"
TARGET = APPLY_ROPE


def _wrap_apply_rotary_pos_emb(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                             mla_rotary_interleaved=False, **newer):
        # newer: the keywords megatron-core main added (inverse, mla_output_remove_interleaving,
        # max_seqlen; megatron_releases.SEAMS), passed on only when given, so 0.19.x never sees them
        if cu_seqlens is not None or any(v for k, v in newer.items() if k != "max_seqlen"):
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group,
                            mla_rotary_interleaved=mla_rotary_interleaved, **newer)
        if mla_rotary_interleaved is None:  # megatron's own default for a None flag
            mla_rotary_interleaved = config.multi_latent_attention
        return apply_rotary(t, freqs, interleaved=bool(config.rotary_interleaved),
                            mla_interleaved=bool(mla_rotary_interleaved), mscale=mscale)

    return apply_rotary_pos_emb


def patches(args) -> list[Patch]:
    return [Patch(TARGET, _wrap_apply_rotary_pos_emb, "wrap", FEATURE)]
