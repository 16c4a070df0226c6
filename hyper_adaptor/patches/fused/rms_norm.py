"""Level 1: megatron's local-spec RMSNorm (``WrappedTorchNorm`` -> ``torch.nn.RMSNorm``) becomes
:class:`hyper_adaptor.ops.rms_norm.FusedRMSNorm`; LayerNorm and L2Norm stay megatron's.

Composition with level 0: compat also wraps ``WrappedTorchNorm.__new__`` (it lets sequence parallel
through and marks the norm's parameters ``sequence_parallel``). This wrap is declared after compat,
so it is the outer one and builds the RMSNorm itself, marking its parameters with compat's
``mark_sequence_parallel``; other norms go through compat's wrap (hence the original).
"""

from __future__ import annotations

import functools

from hyper_adaptor.patch_manager import Patch
from hyper_adaptor.patches.compat.megatron_core import mark_sequence_parallel

FEATURE = "fused_rmsnorm"
TARGET = "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__"


def _build_fused_rmsnorm(original_new):
    @functools.wraps(original_new)
    def build(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if getattr(config, "normalization", None) != "RMSNorm":
            return original_new(cls, config, hidden_size, eps, *args, **kwargs)
        from hyper_adaptor.ops.rms_norm import FusedRMSNorm

        norm = FusedRMSNorm(
            hidden_size,
            eps,
            zero_centered_gamma=bool(getattr(config, "layernorm_zero_centered_gamma", False)),
        )  # default dtype and device, like the torch.nn.RMSNorm it replaces (the model casts later)
        return mark_sequence_parallel(norm, config)

    return build


def patches(args) -> list[Patch]:
    return [Patch(TARGET, _build_fused_rmsnorm, "wrap", FEATURE, after=("compat",))]
