"""Level 1 — fused rotary position embedding (hyper_adaptor/ops/rope.py) in megatron's rope_utils."""

from __future__ import annotations

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag


class FusedRoPE(Feature):
    name = "fused_rope"
    level = 1
    summary = "RoPE (interleaved or not, partial rotary): torch_npu npu_rotary_mul / compiled / eager"
    flags = (
        Flag(
            "--use-fused-rotary-pos-emb",
            "Fused rotary position embedding; needs --position-embedding-type rope (level 1).",
        ),
    )

    def validate(self, args) -> None:
        kind = getattr(args, "position_embedding_type", "rope")
        if kind not in ("rope", "yarn"):
            raise FeatureConfigError(
                f"--use-fused-rotary-pos-emb needs --position-embedding-type rope, got {kind}"
            )

    def patches(self, args):
        from hyper_adaptor.patches.fused import rope

        return rope.patches(args)
