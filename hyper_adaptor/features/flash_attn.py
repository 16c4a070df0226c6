"""Level 1 — flash / fused core attention in place of megatron's local DotProductAttention.

The flag is Megatron's own ``--use-flash-attn`` (which on megatron's side only matters with
TransformerEngine); with the local spec, hyper_adaptor serves it with hyper_adaptor/ops/attention.py.
"""

from __future__ import annotations

from hyper_adaptor.features.base import Feature, Flag
from hyper_adaptor.features.fused_common import require_local_impl


class FlashAttention(Feature):
    name = "flash_attn"
    level = 1
    summary = "core attention: torch_npu npu_fusion_attention / torch SDPA (flash, O(s) memory) / eager"
    flags = (Flag("--use-flash-attn", "megatron's flag; served by hyper_adaptor at level >= 1", owner="megatron"),)

    def validate(self, args) -> None:
        require_local_impl(args, "--use-flash-attn")

    def patches(self, args):
        from hyper_adaptor.patches.fused import attention

        return attention.patches(args)
