"""One decision table for megatron's fusion switches, shared by both ways a run reaches them.

* megatron.training's parsed arguments (``arguments.switch_unworkable_defaults``, an ``adjust`` step);
* a ``TransformerConfig`` built directly by a megatron-core library user (NeMo, verl, in-house
  trainers): its ``__post_init__`` is wrapped, because that is where megatron-core refuses a switch it
  has no kernel for (``apply_rope_fusion`` raises "Please install TE >= 1.4") or where a later module
  build would fail (``gradient_accumulation_fusion`` without apex's fused_weight_gradient_mlp_cuda).

Each switch either works natively (the kernel megatron looks for is installed on this device), is
served by a level-1 feature of hyper_adaptor at ``--optimization-level`` >= 1, or is switched off
with one notice. Switches megatron serves with its own torch code on every device
(``bias_activation_fusion``, ``bias_dropout_fusion``: torch.jit functions) are not listed: nothing
needs deciding for them.

The level for a config built without a command line: the one given to ``hyper_adaptor.adapt(args)``
if it was called, else ``HYPER_ADAPTOR_OPTIMIZATION_LEVEL``, else the command line's default. The
adaptor's answers (that level, applying a level-1 feature) come through
:mod:`hyper_adaptor.patches.adaptor_hooks`, filled at bootstrap.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from hyper_adaptor.patch_manager import Patch
from hyper_adaptor.patches import adaptor_hooks

FEATURE = "compat"
LEVEL_ENV = "HYPER_ADAPTOR_OPTIMIZATION_LEVEL"
CONFIG_POST_INIT = "megatron.core.transformer.transformer_config.TransformerConfig.__post_init__"


def _installed(module: str) -> bool:
    from hyper_adaptor.patches.compat.arguments import _installed as installed

    return installed(module)


@dataclasses.dataclass(frozen=True)
class Switch:
    name: str                # the TransformerConfig field (megatron.training's dest, except persist)
    native: tuple            # modules of which any one lets megatron serve it itself, on CUDA only
    served_by: str | None    # the level-1 feature that serves it, if any
    keep_when_served: bool   # served through megatron's own path (True) or by a hyper_adaptor wrap (False)
    why_off: str


SWITCHES = {
    s.name: s
    for s in (
        Switch("persist_layer_norm", ("fast_layer_norm",), None, False,
               "the persistent layer-norm kernel needs apex on CUDA"),
        # From level 1 hyper_adaptor provides apex's kernel, so megatron's own flag stays on.
        Switch("gradient_accumulation_fusion", ("fused_weight_gradient_mlp_cuda", "transformer_engine"),
               "grad_accum_fusion", True,
               "its fused weight-gradient kernel needs apex or transformer_engine on CUDA, "
               "or --optimization-level >= 1"),
        Switch("masked_softmax_fusion", ("scaled_masked_softmax_cuda",), None, False,
               "the fused masked softmax kernel needs apex on CUDA"),
        # From level 1 hyper_adaptor's wrap of apply_rotary_pos_emb fuses RoPE for every call it sees;
        # megatron's own flag must go off, or its TE-only branches (thd, MLA) would be taken.
        Switch("apply_rope_fusion", ("transformer_engine",), "fused_rope", False,
               "fused RoPE needs transformer_engine on CUDA, or --optimization-level >= 1 "
               "(on the command line with --use-fused-rotary-pos-emb)"),
    )
}


def native(switch: Switch, device_type: str) -> bool:
    # apex's kernels are top-level compiled modules (the unrelated PyPI "apex" has none of them)
    return device_type == "cuda" and any(_installed(module) for module in switch.native)


@dataclasses.dataclass(frozen=True)
class Decision:
    value: bool          # what megatron's switch is set to
    served_by: str | None  # the level-1 feature to apply, if any
    why: str | None      # the notice's reason; None when nothing changes


def decide(name: str, device_type: str, level: int, feature_available: bool = True) -> Decision:
    """The decision for switch ``name`` set to True. ``feature_available``: whether the serving
    feature may apply (on the command line it must itself be enabled, e.g. --use-fused-rotary-pos-emb)."""
    switch = SWITCHES[name]
    if native(switch, device_type):
        return Decision(True, None, None)
    if switch.served_by and level >= 1 and feature_available:
        why = None if switch.keep_when_served else f"served by hyper_adaptor's {switch.served_by} (level 1)"
        return Decision(switch.keep_when_served, switch.served_by, why)
    return Decision(False, None, switch.why_off)


def optimization_level() -> int:
    """The level for code that has no command line (see the module docstring)."""
    hooks = adaptor_hooks.current()
    prepared = hooks.level()
    if prepared is not None:
        return prepared
    value = os.environ.get(LEVEL_ENV)
    if value is None:
        return hooks.default_level
    if value not in ("0", "1", "2"):
        raise ValueError(f"{LEVEL_ENV} must be 0, 1 or 2; got {value!r}")
    return int(value)


def _deciding_fusion_switches(original):
    @functools.wraps(original)
    def __post_init__(self):
        from hyper_adaptor import platform
        from hyper_adaptor.notice import notice

        level = optimization_level()
        apply_feature = adaptor_hooks.current().apply_feature
        for name in SWITCHES:
            if not getattr(self, name, False):
                continue
            decision = decide(name, platform.device_type(), level)
            setattr(self, name, decision.value)
            if decision.served_by and apply_feature is not None:
                apply_feature(decision.served_by, level)
            if decision.why:
                notice(f"TransformerConfig.{name}: True -> {decision.value} ({decision.why})")
        return original(self)

    return __post_init__


def patches() -> list[Patch]:
    return [Patch(CONFIG_POST_INIT, _deciding_fusion_switches, "wrap", FEATURE)]
