"""The TransformerEngine layer spec without TransformerEngine (level 0, megatron-core library users).

megatron-core library users (NeMo, Megatron-Bridge, verl, in-house trainers) build their layers with
``get_gpt_layer_with_transformer_engine_spec()`` and never pass megatron.training's
``--transformer-impl``, so the argument switch in ``arguments.py`` never reaches them. Without TE,
``gpt_layer_specs.TESpecProvider`` (and ``multi_token_prediction.TESpecProvider``) is ``None`` ->
"'NoneType' object is not callable", and the real class in ``transformer_engine_spec_provider`` (which
``moe_module_specs`` imports) names TE modules that are ``None``.

Here those three names become ``LocalTESpecProvider``: megatron's local modules, except that the
fused norm + linear keeps TE's role and layout — ``LayerNormColumnParallelLinear`` below owns
``layer_norm_weight`` / ``layer_norm_bias`` next to ``weight`` / ``bias`` exactly as
``TELayerNormColumnParallelLinear`` (te.pytorch.LayerNormLinear) does, so the layer's state_dict and
sharded_state_dict keys are TE's and checkpoints move between a TE run on GPU and this one.

TE's keys, from megatron/core/extensions/transformer_engine.py, for one GPT layer:
  self_attention.linear_qkv.{layer_norm_weight, layer_norm_bias, weight, bias, _extra_state}
      (TELayerNormColumnParallelLinear; weight/bias sharded on axis 0, the norm replicated)
  self_attention.linear_proj.{weight, bias, _extra_state}   (TERowParallelLinear, weight axis 1)
  self_attention.core_attention: nothing unless softmax_type == "learnable" (TEDotProductAttention)
  mlp.linear_fc1.{layer_norm_weight, layer_norm_bias, weight, bias, _extra_state}
  mlp.linear_fc2.{weight, bias, _extra_state}
(``layer_norm_bias`` only with normalization="LayerNorm", as in TE.)

Options only TE can honour are refused with their name rather than silently ignored.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hyper_adaptor.notice import notice
from hyper_adaptor.patch_manager import Patch

FEATURE = "compat"
SPECS = "megatron.core.models.gpt.gpt_layer_specs"
PROVIDER_MODULE = "megatron.core.extensions.transformer_engine_spec_provider"
MTP = "megatron.core.transformer.multi_token_prediction"

NOTICE = ("TransformerEngine is not installed: the TE layer spec (TESpecProvider) is served by "
          "megatron's local modules with a TE-compatible fused norm+linear (same parameter names)")

# Spec-function keywords that only TE (or NVIDIA's kitchen) can serve: a truthy value is refused.
TE_ONLY_SPEC_OPTIONS = ("use_te_op_fuser", "use_te_activation_func", "use_kitchen",
                        "use_grouped_gemm_for_dense_mlp")


class TEOnlyOptionError(ValueError):
    """An option of the TE spec that the local stand-ins cannot honour."""


def refuse(option: str) -> None:
    raise TEOnlyOptionError(
        f"{option} needs TransformerEngine, which is not installed: the TE layer spec is served by "
        f"megatron's local modules here; drop {option}")


def rms_norm(x, weight, eps):
    """The stand-in's RMSNorm: torch's. Level 1's fused RMSNorm feature replaces this function with
    its op (patches/fused/rms_norm.py), as it replaces the local spec's separate RMSNorm modules."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _layer_norm_column_parallel_linear_class():
    # Built lazily: megatron.core must not be imported when this module is (import shims come first).
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
        """TELayerNormColumnParallelLinear's role on megatron's ColumnParallelLinear: the layer norm
        of the input, then the column-parallel linear; parameters named as TE names them."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            if getattr(config, "fp8", None):
                refuse("fp8")
            if getattr(config, "fp4", None):
                refuse("fp4")
            if config.normalization not in ("LayerNorm", "RMSNorm"):
                raise TEOnlyOptionError(f"normalization={config.normalization!r} is not served by the "
                                        f"local TE stand-in (LayerNorm or RMSNorm)")
            # TE's LayerNormLinear takes no such arguments; the spec passes them for TE's sake
            kwargs.pop("tp_comm_buffer_name", None)
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.normalization = config.normalization
            self.eps = config.layernorm_epsilon
            self.zero_centered_gamma = config.layernorm_zero_centered_gamma
            init = torch.zeros if self.zero_centered_gamma else torch.ones
            dtype = config.params_dtype
            self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=dtype))
            self.layer_norm_bias = (
                torch.nn.Parameter(torch.zeros(input_size, dtype=dtype))
                if self.normalization == "LayerNorm" else None
            )
            for p in (self.layer_norm_weight, self.layer_norm_bias):
                if p is not None:
                    # with sequence parallel each TP rank normalises its own tokens: the norm's
                    # gradients are partial and megatron all-reduces params flagged like this
                    p.sequence_parallel = config.sequence_parallel

        def _norm(self, x):
            weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
            if self.normalization == "LayerNorm":
                return F.layer_norm(x, (x.shape[-1],), weight, self.layer_norm_bias, self.eps)
            return rms_norm(x, weight, self.eps)  # looked up per call: level 1 may have replaced it

        def forward(self, input_, *args, **kwargs):
            return super().forward(self._norm(input_), *args, **kwargs)

    return LayerNormColumnParallelLinear


@functools.cache
def layer_norm_column_parallel_linear():
    return _layer_norm_column_parallel_linear_class()


@functools.cache
def provider_class():
    from megatron.core.models.backends import LocalSpecProvider

    class LocalTESpecProvider(LocalSpecProvider):
        """TESpecProvider's answers from megatron's local modules (TE is not installed)."""

        def __init__(self, *args, **kwargs):
            notice(NOTICE)
            super().__init__()

        def linear(self):
            # TELinear's role: a plain (non-parallel) linear, as in TE's duplicated mode
            from megatron.core.tensor_parallel.layers import ColumnParallelLinear

            return ColumnParallelLinear

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self):
            return layer_norm_column_parallel_linear()

        def activation_func(self):
            # TE's activation op; the spec functions refuse use_te_activation_func before asking
            return None

    return LocalTESpecProvider


def _refusing_te_options(original):
    @functools.wraps(original)
    def te_submodules(*args, **kwargs):
        for option in TE_ONLY_SPEC_OPTIONS:
            if kwargs.get(option):
                refuse(option)
        return original(*args, **kwargs)

    return te_submodules


def te_installed() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def patches() -> list:
    """Nothing where TE is installed: then its spec is the real one."""
    if te_installed():
        return []
    provider = provider_class()
    return [
        # gpt_layer_specs and multi_token_prediction hold None here (not rebound by identity: None is
        # shared with every module), so each name is replaced where it lives
        Patch(f"{SPECS}.TESpecProvider", provider, "replace", FEATURE, rebind_in=()),
        Patch(f"{MTP}.TESpecProvider", provider, "replace", FEATURE, rebind_in=()),
        # the class itself, which moe_module_specs imported by name
        Patch(f"{PROVIDER_MODULE}.TESpecProvider", provider, "replace", FEATURE),
        Patch(f"{SPECS}.get_gpt_layer_with_transformer_engine_submodules", _refusing_te_options, "wrap",
              FEATURE),
    ]
