"""Level 2 — MindSpeed's recompute flags on megatron's layers, on every device (docs/features/memory.md).

- ``--recompute-activation-function``: the MLP's activation recomputed in backward (a selective
  checkpoint that saves the matrix products; seam: ``hyper_adaptor/patches/memory/layers.py``);
- ``--recompute-norm``: megatron's own selective recompute of the norms (``--recompute-modules
  layernorm``), which works on the local spec at level 0: ``adjust`` writes it into megatron's flags.

Combinations that cannot work (with a full recompute, or with the MLP already recomputed or swapped) are
errors naming the flags.
"""

from __future__ import annotations

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag, switch
from hyper_adaptor.features.swap import first_layers, swap_names
from hyper_adaptor.patches.memory.layers import MemoryPlan


class Recompute(Feature):
    name = "recompute"
    level = 2
    summary = "--recompute-activation-function (MLP activation rebuilt in backward), --recompute-norm"
    flags = (
        Flag("--recompute-activation-function", "recompute the MLP activation in backward instead of keeping "
                                                "its output (MindSpeed's flag)"),
        Flag("--recompute-norm", "recompute the layer norms in backward (MindSpeed's flag; megatron's "
                                 "selective recompute of 'layernorm')"),
    )

    def status(self, args) -> tuple[bool, str]:
        applies, why = super().status(args)
        if applies and not getattr(args, "recompute_activation_function", False):
            why += " (--recompute-norm: megatron's own selective recompute, set by adjust; nothing to patch)"
        return applies, why

    def adjust(self, args) -> list[str]:
        notices = []
        granularity = getattr(args, "recompute_granularity", None)
        if getattr(args, "recompute_norm", False) and granularity != "full":
            modules = list(getattr(args, "recompute_modules", None) or [])
            if granularity != "selective":
                notices.append(switch(args, "recompute_granularity", "selective", "--recompute-norm"))
                modules = []
            if "layernorm" not in modules:
                notices.append(switch(args, "recompute_modules", modules + ["layernorm"], "--recompute-norm"))
        return notices

    def validate(self, args) -> None:
        granularity = getattr(args, "recompute_granularity", None)
        recomputed = set(getattr(args, "recompute_modules", None) or []) if granularity == "selective" else set()
        if getattr(args, "recompute_activation_function", False):
            if granularity == "full":
                raise FeatureConfigError("--recompute-activation-function with --recompute-granularity full: the "
                                         "full recompute already recomputes the activation")
            swapped = set(swap_names(args))
            if "mlp" in recomputed or "mlp" in swapped or "layer" in swapped or first_layers(args):
                raise FeatureConfigError("--recompute-activation-function wraps the MLP, which is already recomputed "
                                         "or swapped (--recompute-modules mlp / --swap-modules mlp|layer / "
                                         "--cpu-offloading-num-layers)")
        if getattr(args, "recompute_norm", False) and granularity == "full":
            raise FeatureConfigError("--recompute-norm with --recompute-granularity full: the full recompute "
                                     "already recomputes the norms")

    def patches(self, args):
        from hyper_adaptor.patches.memory import layers

        plan = MemoryPlan(recompute_activation=bool(getattr(args, "recompute_activation_function", False)))
        # the swap feature wraps the same block constructor; the two wrap different submodules
        return layers.patches(plan, feature=self.name, after=("swap",))
