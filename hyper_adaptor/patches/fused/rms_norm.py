"""Level 1: megatron's local-spec RMSNorm (``WrappedTorchNorm`` -> ``torch.nn.RMSNorm``) becomes
:class:`hyper_adaptor.ops.rms_norm.FusedRMSNorm`; LayerNorm and L2Norm stay megatron's.

Composition with level 0: compat also wraps ``WrappedTorchNorm.__new__`` (it lets sequence parallel
through and marks the norm's parameters ``sequence_parallel``). This wrap is declared after compat,
so it is the outer one and builds the RMSNorm itself, marking its parameters with compat's
``mark_sequence_parallel``; other norms go through compat's wrap (hence the original).

The TE layer spec's stand-in norm + linear (patches/compat/te_spec.py, served where TransformerEngine is
not installed) normalises through ``te_spec.rms_norm``; the same feature replaces that function with the
op, so a TE-spec model gets the fused RMSNorm like a local-spec one.
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


# the fused norm + linear that serves the TE layer spec without TE (patches/compat/te_spec.py)
TE_STAND_IN_NORM = "hyper_adaptor.patches.compat.te_spec.rms_norm"


def _op_rms_norm(x, weight, eps):
    from hyper_adaptor.ops.rms_norm import rms_norm

    return rms_norm(x, weight, eps)


def patches(args) -> list[Patch]:
    return [
        Patch(TARGET, _build_fused_rmsnorm, "wrap", FEATURE, after=("compat",)),
        Patch(TE_STAND_IN_NORM, _op_rms_norm, "replace", FEATURE, rebind_in=()),
    ]
