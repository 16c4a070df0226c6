"""Level 2 — memory: activation swap to host with prefetch, recompute of the activation function and
the norms, and optimizer offload, on every device (docs/features/memory.md).

megatron-core 0.19.2 serves its offload flags only through TransformerEngine or CUDA streams
(``--cpu-offloading-num-layers`` asserts TE in ``TransformerBlock``, ``--fine-grained-activation-offloading``
asserts ``--transformer-impl transformer_engine``). This feature serves them, and MindSpeed's flags, with
the engine in ``hyper_adaptor/memory``:

- ``--swap-attention`` (MindSpeed's name): each layer's self-attention activations swapped;
  ``--swap-modules`` names what to swap per layer in the style of ``--recompute-modules`` (``layer``,
  ``self_attn``, ``core_attn``, ``mlp``, ``layernorm``); ``--swap-prefetch-layers N`` groups loaded ahead
  in backward (default 1). Tensors under megatron's ``--min-offloaded-tensor-size`` stay;
- megatron's ``--cpu-offloading-num-layers N``: the first N layers of each block swapped whole; hidden from
  megatron's checks (its TE context is not built) and served by the engine;
- megatron's ``--fine-grained-activation-offloading --offload-modules ...``: the named modules swapped;
  megatron's flag is switched off (its own CUDA-stream offload code must not run) and served by the engine;
- ``--recompute-activation-function`` (MindSpeed's): the MLP's activation recomputed in backward (selective
  checkpoint saving the matrix products); ``--recompute-norm`` (MindSpeed's): megatron's own selective
  recompute of the norms (``--recompute-modules layernorm``), which works on the local spec at level 0;
- megatron's ``--optimizer-cpu-offload`` / ``--optimizer-offload-fraction``: the optimizer's state and
  master weights on the host (``patches/memory/optimizer.py``).

Combinations that cannot work are errors naming the flags; below level 2 the flags get the usual notice.
"""

from __future__ import annotations

from hyper_adaptor.features import memory_optimizer
from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag, asked, hide_from_megatron, switch
from hyper_adaptor.patches.memory.layers import OFFLOAD_MODULES, SWAP_MODULES, MemoryPlan

# what adjust took off megatron's fine-grained offloading flags (megatron must not run its own offload)
OFFLOAD_REQUEST = "hyper_memory_offload_modules"
# the swap-modules that contain others (a module is swapped once)
_NESTED = {"layer": set(SWAP_MODULES) - {"layer"}, "self_attn": {"core_attn"}}


def _offload_modules(args) -> list[str]:
    request = getattr(args, OFFLOAD_REQUEST, None)
    if request is not None:
        return list(request)
    if getattr(args, "fine_grained_activation_offloading", False):
        return list(getattr(args, "offload_modules", None) or [])
    return []


def _swap_names(args) -> list[str]:
    names = list(getattr(args, "swap_modules", None) or [])
    if getattr(args, "swap_attention", False) and "self_attn" not in names:
        names.append("self_attn")
    return names


def _first_layers(args) -> int:
    return int(asked(args, "cpu_offloading_num_layers") or 0)


class Memory(Feature):
    name = "memory"
    level = 2
    summary = ("activation swap to host with prefetch (--swap-attention, --swap-modules, megatron's "
               "--cpu-offloading-num-layers and fine-grained offloading), --recompute-activation-function, "
               "--recompute-norm, optimizer offload (--optimizer-cpu-offload)")
    flags = (
        Flag("--swap-attention", "swap each layer's self-attention activations to host, prefetched in backward "
                                 "(MindSpeed's flag)"),
        Flag("--swap-modules", "what to swap to host in every layer: " + ", ".join(SWAP_MODULES),
             kwargs=dict(nargs="+", choices=SWAP_MODULES, default=None)),
        Flag("--swap-prefetch-layers", "swap groups loaded ahead in backward (default 1; 0 loads each when needed)",
             kwargs=dict(type=int, default=None)),
        Flag("--recompute-activation-function", "recompute the MLP activation in backward instead of keeping "
                                                "its output (MindSpeed's flag)"),
        Flag("--recompute-norm", "recompute the layer norms in backward (MindSpeed's flag; megatron's "
                                 "selective recompute of 'layernorm')"),
        Flag("--cpu-offloading-num-layers", "megatron's; served by hyper_adaptor's swap engine",
             kwargs=dict(type=int, default=0), owner="megatron"),
        Flag("--fine-grained-activation-offloading", "megatron's; served by hyper_adaptor's swap engine",
             owner="megatron"),
        Flag("--optimizer-cpu-offload", "megatron's; served by hyper_adaptor's optimizer offload", owner="megatron"),
    )

    def __init__(self):
        self.plan: MemoryPlan | None = None  # the last plan applied (tests and bench read its swap manager)

    def requested(self, args) -> bool:
        return bool(_swap_names(args) or _offload_modules(args) or _first_layers(args)
                    or getattr(args, "swap_prefetch_layers", None) is not None
                    or getattr(args, "recompute_activation_function", False) or getattr(args, "recompute_norm", False)
                    or asked(args, "optimizer_cpu_offload"))

    def asked_explicitly(self, args) -> bool:
        return self.requested(args)

    def adjust(self, args) -> list[str]:
        notices = []
        if _first_layers(args):
            # megatron's validate_args would set cpu_offloading, and TransformerBlock asserts TE for it
            hide_from_megatron(args, "cpu_offloading_num_layers")
        if getattr(args, "fine_grained_activation_offloading", False):
            setattr(args, OFFLOAD_REQUEST, list(getattr(args, "offload_modules", None) or []))
            why = "served by hyper_adaptor's swap engine (megatron's own offload needs TE and CUDA streams)"
            notices.append(switch(args, "fine_grained_activation_offloading", False, why))
            notices.append(switch(args, "offload_modules", [], why))
        if getattr(args, "recompute_norm", False) and getattr(args, "recompute_granularity", None) != "full":
            modules = list(getattr(args, "recompute_modules", None) or [])
            if getattr(args, "recompute_granularity", None) != "selective":
                notices.append(switch(args, "recompute_granularity", "selective", "--recompute-norm"))
                modules = []
            if "layernorm" not in modules:
                notices.append(switch(args, "recompute_modules", modules + ["layernorm"], "--recompute-norm"))
        if asked(args, "optimizer_cpu_offload"):
            notices += memory_optimizer.adjust(args)
        return notices

    def validate(self, args) -> None:
        names = _swap_names(args)
        for outer, inner in _NESTED.items():
            clash = sorted(inner & set(names)) if outer in names else []
            if clash:
                raise FeatureConfigError(f"--swap-modules {outer} already swaps {', '.join(clash)}: name one of them")
        offload = _offload_modules(args)
        if getattr(args, OFFLOAD_REQUEST, None) is not None and not offload:
            raise FeatureConfigError("--fine-grained-activation-offloading needs --offload-modules "
                                     f"(served here: {', '.join(OFFLOAD_MODULES)})")
        unknown = sorted(set(offload) - set(OFFLOAD_MODULES))
        if unknown:
            raise FeatureConfigError(f"--offload-modules {' '.join(unknown)} is not served by hyper_adaptor's swap "
                                     f"engine (served: {', '.join(OFFLOAD_MODULES)})")
        prefetch = getattr(args, "swap_prefetch_layers", None)
        if prefetch is not None and prefetch < 0:
            raise FeatureConfigError(f"--swap-prefetch-layers must be >= 0; got {prefetch}")
        first = _first_layers(args)
        layers = getattr(args, "num_layers", None)
        if first < 0 or (layers and first > layers):
            raise FeatureConfigError(f"--cpu-offloading-num-layers must be in [0, --num-layers={layers}]; got {first}")
        swapping = bool(names or offload or first)
        granularity = getattr(args, "recompute_granularity", None)
        if swapping and granularity == "full":
            raise FeatureConfigError("swapping and fully recomputing the same layers: --recompute-granularity full "
                                     "recomputes what --swap-attention / --swap-modules / --cpu-offloading-num-layers "
                                     "/ --offload-modules would move; choose one")
        recomputed = set(getattr(args, "recompute_modules", None) or []) if granularity == "selective" else set()
        for module in sorted(recomputed & (set(names) | set(offload))):
            raise FeatureConfigError(f"'{module}' is in --recompute-modules and is swapped (--swap-modules / "
                                     f"--offload-modules): a module is recomputed or swapped, not both")
        if getattr(args, "recompute_activation_function", False):
            if granularity == "full":
                raise FeatureConfigError("--recompute-activation-function with --recompute-granularity full: the "
                                         "full recompute already recomputes the activation")
            if "mlp" in recomputed or "mlp" in names or "layer" in names or first:
                raise FeatureConfigError("--recompute-activation-function wraps the MLP, which is already recomputed "
                                         "or swapped (--recompute-modules mlp / --swap-modules mlp|layer / "
                                         "--cpu-offloading-num-layers)")
        if getattr(args, "recompute_norm", False) and granularity == "full":
            raise FeatureConfigError("--recompute-norm with --recompute-granularity full: the full recompute "
                                     "already recomputes the norms")
        if asked(args, "optimizer_cpu_offload"):
            memory_optimizer.validate(args)

    def make_plan(self, args) -> MemoryPlan:
        names = _swap_names(args)
        names += [m for m in _offload_modules(args) if m not in names]
        prefetch = getattr(args, "swap_prefetch_layers", None)
        min_bytes = getattr(args, "min_offloaded_tensor_size", None)
        return MemoryPlan(swap=tuple(names), swap_first_layers=_first_layers(args),
                          prefetch=1 if prefetch is None else int(prefetch),
                          min_bytes=1 << 20 if min_bytes is None else int(min_bytes),
                          recompute_activation=bool(getattr(args, "recompute_activation_function", False)))

    def patches(self, args):
        from hyper_adaptor.patches.memory import layers

        self.plan = self.make_plan(args)
        result = layers.patches(self.plan)
        if asked(args, "optimizer_cpu_offload"):
            from hyper_adaptor.patches.memory import optimizer

            result += optimizer.patches(args)
        return result
