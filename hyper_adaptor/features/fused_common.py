"""Shared checks of the level-1 fused-kernel features (one feature per file around this)."""

from __future__ import annotations

from hyper_adaptor.features.base import FeatureConfigError


def require_local_impl(args, flag: str) -> None:
    """The fused ops replace components of megatron's local (non-TransformerEngine) layer spec."""
    impl = getattr(args, "transformer_impl", "local")
    if impl != "local":
        raise FeatureConfigError(
            f"{flag} swaps a component of megatron's local layer spec, but --transformer-impl is {impl!r}; "
            "use --transformer-impl local (TransformerEngine brings its own fused kernels)"
        )
