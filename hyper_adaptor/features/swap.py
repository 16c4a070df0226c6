"""Level 2 — activation swap to host with prefetch, on every device (docs/features/memory.md).

megatron-core 0.19.2 serves its activation offload flags only through TransformerEngine or CUDA streams
(``--cpu-offloading-num-layers`` asserts TE in ``TransformerBlock``, ``--fine-grained-activation-offloading``
asserts ``--transformer-impl transformer_engine``). This feature serves them, and MindSpeed's flag, with the
swap engine in ``hyper_adaptor/memory`` (seam: ``hyper_adaptor/patches/memory/layers.py``):

- ``--swap-attention`` (MindSpeed's name): each layer's self-attention activations swapped;
  ``--swap-modules`` names what to swap per layer in the style of ``--recompute-modules`` (``layer``,
  ``self_attn``, ``core_attn``, ``mlp``, ``layernorm``); ``--swap-prefetch-layers N`` groups loaded ahead
  in backward (default 1). Tensors under megatron's ``--min-offloaded-tensor-size`` stay;
- megatron's ``--cpu-offloading-num-layers N``: the first N layers of each block swapped whole; hidden from
  megatron's checks (its TE context is not built) and served by the engine;
- megatron's ``--fine-grained-activation-offloading --offload-modules ...``: the named modules swapped;
  both flags are taken from megatron for the run (its own CUDA-stream offload code must not run).

Combinations that cannot work are errors naming the flags.
"""

from __future__ import annotations

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag, asked, hide_from_megatron, take_from_megatron
from hyper_adaptor.patches.memory.layers import OFFLOAD_MODULES, SWAP_MODULES, MemoryPlan

# the swap-modules that contain others (a module is swapped once)
_NESTED = {"layer": set(SWAP_MODULES) - {"layer"}, "self_attn": {"core_attn"}}
_SERVED_HERE = "served by hyper_adaptor's swap engine (megatron's own offload needs TE and CUDA streams)"


def offload_modules(args) -> list[str]:
    """megatron's --offload-modules as asked, when --fine-grained-activation-offloading was."""
    if asked(args, "fine_grained_activation_offloading"):
        return list(asked(args, "offload_modules") or [])
    return []


def swap_names(args) -> list[str]:
    names = list(getattr(args, "swap_modules", None) or [])
    if getattr(args, "swap_attention", False) and "self_attn" not in names:
        names.append("self_attn")
    return names


def first_layers(args) -> int:
    return int(asked(args, "cpu_offloading_num_layers") or 0)


def make_plan(args) -> MemoryPlan:
    """What the swap seam does for these flags (pure: a new plan each call)."""
    names = swap_names(args)
    names += [m for m in offload_modules(args) if m not in names]
    prefetch = getattr(args, "swap_prefetch_layers", None)
    min_bytes = getattr(args, "min_offloaded_tensor_size", None)
    return MemoryPlan(swap=tuple(names), swap_first_layers=first_layers(args),
                      prefetch=1 if prefetch is None else int(prefetch),
                      min_bytes=1 << 20 if min_bytes is None else int(min_bytes))


class Swap(Feature):
    name = "swap"
    level = 2
    summary = ("activation swap to host with prefetch: --swap-attention, --swap-modules, megatron's "
               "--cpu-offloading-num-layers and --fine-grained-activation-offloading")
    flags = (
        Flag("--swap-attention", "swap each layer's self-attention activations to host, prefetched in backward "
                                 "(MindSpeed's flag)"),
        Flag("--swap-modules", "what to swap to host in every layer: " + ", ".join(SWAP_MODULES),
             kwargs=dict(nargs="+", choices=SWAP_MODULES, default=None)),
        Flag("--swap-prefetch-layers", "swap groups loaded ahead in backward (default 1; 0 loads each when needed)",
             kwargs=dict(type=int, default=None)),
        Flag("--cpu-offloading-num-layers", "megatron's; served by hyper_adaptor's swap engine",
             kwargs=dict(type=int, default=0), owner="megatron"),
        Flag("--fine-grained-activation-offloading", "megatron's; served by hyper_adaptor's swap engine",
             owner="megatron"),
        Flag("--offload-modules", "megatron's; the modules --fine-grained-activation-offloading swaps",
             kwargs=dict(nargs="+", default=None), owner="megatron"),
    )

    def requested(self, args) -> bool:
        return bool(swap_names(args) or asked(args, "fine_grained_activation_offloading") or first_layers(args)
                    or getattr(args, "swap_prefetch_layers", None) is not None)

    def adjust(self, args) -> list[str]:
        notices = []
        if first_layers(args):
            # megatron's validate_args would set cpu_offloading, and TransformerBlock asserts TE for it
            notices.append(hide_from_megatron(args, "cpu_offloading_num_layers", _SERVED_HERE))
        if getattr(args, "fine_grained_activation_offloading", False):
            notices.append(take_from_megatron(args, "fine_grained_activation_offloading", False, _SERVED_HERE))
            if getattr(args, "offload_modules", None):
                notices.append(take_from_megatron(args, "offload_modules", [], _SERVED_HERE))
        return notices

    def validate(self, args) -> None:
        names = swap_names(args)
        for outer, inner in _NESTED.items():
            clash = sorted(inner & set(names)) if outer in names else []
            if clash:
                raise FeatureConfigError(f"--swap-modules {outer} already swaps {', '.join(clash)}: name one of them")
        offload = offload_modules(args)
        if asked(args, "fine_grained_activation_offloading") and not offload:
            raise FeatureConfigError("--fine-grained-activation-offloading needs --offload-modules "
                                     f"(served here: {', '.join(OFFLOAD_MODULES)})")
        unknown = sorted(set(offload) - set(OFFLOAD_MODULES))
        if unknown:
            raise FeatureConfigError(f"--offload-modules {' '.join(unknown)} is not served by hyper_adaptor's swap "
                                     f"engine (served: {', '.join(OFFLOAD_MODULES)})")
        prefetch = getattr(args, "swap_prefetch_layers", None)
        if prefetch is not None and prefetch < 0:
            raise FeatureConfigError(f"--swap-prefetch-layers must be >= 0; got {prefetch}")
        first = first_layers(args)
        layers = getattr(args, "num_layers", None)
        if first < 0 or (layers and first > layers):
            raise FeatureConfigError(f"--cpu-offloading-num-layers must be in [0, --num-layers={layers}]; got {first}")
        min_bytes = getattr(args, "min_offloaded_tensor_size", None)
        if min_bytes is not None and min_bytes < 0:
            raise FeatureConfigError(f"--min-offloaded-tensor-size must be >= 0 (bytes); got {min_bytes}")
        granularity = getattr(args, "recompute_granularity", None)
        if (names or offload or first) and granularity == "full":
            raise FeatureConfigError("swapping and fully recomputing the same layers: --recompute-granularity full "
                                     "recomputes what --swap-attention / --swap-modules / --cpu-offloading-num-layers "
                                     "/ --offload-modules would move; choose one")
        recomputed = set(getattr(args, "recompute_modules", None) or []) if granularity == "selective" else set()
        for module in sorted(recomputed & (set(names) | set(offload))):
            raise FeatureConfigError(f"'{module}' is in --recompute-modules and is swapped (--swap-modules / "
                                     f"--offload-modules): a module is recomputed or swapped, not both")

    def patches(self, args):
        from hyper_adaptor.patches.memory import layers

        return layers.patches(make_plan(args), feature=self.name)
