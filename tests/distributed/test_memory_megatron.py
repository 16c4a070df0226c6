"""The memory features on megatron-core's GPT (features/swap.py, features/recompute.py,
patches/memory/layers.py): each flag's run against the same GPT without it, 2 Adam steps on CPU/gloo, TP2 and
PP2 one after the other in one world.

Swap moves saved activations to the host and back: nothing is recomputed, so losses, gradients and
parameters are bitwise equal (tolerance 0). Recompute reruns forward ops in backward: 1e-6. Every swap
run also shows that bytes were really moved (the engine's own count) — a swap that moved nothing would
pass parity trivially. The flags go through the features' adjust / validate / patches exactly as the
adaptor runs them (megatron's --recompute-* arguments adjust writes reach the model config), with the
patches registered in a PatchManager of the run's own, so each variant starts from unpatched megatron.
"""

import types

import pytest

from hyper_adaptor.testing import run_world
from tests.distributed.gpt_parity import Layout, compare

pytestmark = pytest.mark.distributed

TARGET = "tests.distributed.test_memory_megatron:train_layouts"
BITWISE = dict(loss_rtol=0.0, grad_atol=0.0, param_atol=0.0)
RECOMPUTE = dict(loss_rtol=1e-6, grad_atol=1e-6, param_atol=1e-6)

# flags (as megatron.training would parse them; min size 0: the test model's activations are small)
VARIANTS = {
    "swap_attention": dict(swap_attention=True),
    "swap_layer_prefetch2": dict(swap_modules=["layer"], swap_prefetch_layers=2),
    "swap_core_attn_mlp_norms": dict(swap_modules=["core_attn", "mlp", "layernorm"]),
    "cpu_offloading_2_layers": dict(cpu_offloading_num_layers=2),
    "fine_grained": dict(fine_grained_activation_offloading=True,
                         offload_modules=["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]),
    "recompute_activation_function": dict(recompute_activation_function=True),
    # megatron's norm recompute empties the norm output the swapped attention saved: the engine leaves it
    "swap_attention_recompute_norm": dict(swap_attention=True, recompute_norm=True),
    "recompute_norm": dict(recompute_norm=True),
    # megatron's own selective recompute at level 0 (no hyper_adaptor flag)
    "megatron_selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"]),
}
SWAPPING = {"swap_attention", "swap_layer_prefetch2", "swap_core_attn_mlp_norms", "cpu_offloading_2_layers",
            "fine_grained", "swap_attention_recompute_norm"}


def _args(flags: dict):
    from hyper_adaptor import features

    args = types.SimpleNamespace(optimization_level=2, num_layers=4, min_offloaded_tensor_size=0,
                                 recompute_granularity=None, recompute_modules=None, offload_modules=[],
                                 fine_grained_activation_offloading=False, cpu_offloading_num_layers=0)
    for feature in features.FEATURES:
        feature.fill_defaults(args)
    vars(args).update(flags)
    return args


def train_variants(rank: int, world_size: int, layout: dict, names: list) -> dict:
    from hyper_adaptor.features import base, get
    from hyper_adaptor.patch_manager import PatchManager
    from hyper_adaptor.patches.memory import layers
    from tests.distributed import gpt_parity

    memory = [get("swap"), get("recompute")]
    results = {"reference": gpt_parity.train(rank, world_size, Layout(**layout))}
    for name in names:
        args = _args(VARIANTS[name])
        requested = [feature for feature in memory if feature.requested(args)]
        notices = [n for feature in requested for n in feature.adjust(args)]
        for feature in requested:
            feature.validate(args)
        base.restore_hidden(args)
        extra = dict(layout.get("extra", {}))
        if args.recompute_granularity is not None:
            extra.update(recompute_granularity=args.recompute_granularity, recompute_modules=args.recompute_modules)
        manager = PatchManager()
        patches = [p for feature in requested for p in feature.patches(args)]
        manager.register_all(patches)
        plan = layers.plan_of([p for p in patches if p.feature == "swap"])
        with manager.applied():
            result = gpt_parity.train(rank, world_size, Layout(**dict(layout, extra=extra)))
        result["moved_bytes"] = 0 if plan is None or plan.manager is None else plan.manager.moved_bytes
        result["loaded_bytes"] = 0 if plan is None or plan.manager is None else plan.manager.loaded_bytes
        result["notices"] = notices
        results[name] = result
    return results


def _check(results: dict, names: list) -> None:
    reference = results["reference"]
    for name in names:
        got = results[name]
        tolerance = RECOMPUTE if "recompute" in name or "selective" in name else BITWISE
        diffs = compare(reference, got, **tolerance)
        assert diffs == [], f"{name}:\n" + "\n".join(diffs[:20])
        if name in SWAPPING:
            # bytes really went to the host and came back (2 steps x 4 micro-batches)
            assert got["moved_bytes"] > 0 and got["loaded_bytes"] > 0, name


# two steps: the second's gradients and Adam update depend on the first's (Adam's first update is the
# gradient's sign), and each step saves, moves and recomputes every layer's activations
LAYOUTS = {"TP2": dict(tp=2, steps=2), "PP2": dict(pp=2, steps=2)}


def train_layouts(rank: int, world_size: int, layouts: dict, names: list) -> dict:
    return {key: train_variants(rank, world_size, layout, names) for key, layout in layouts.items()}


@pytest.fixture(scope="module")
def layouts():
    # both layouts are 2-rank worlds: one world runs them one after the other
    return run_world(2, TARGET, timeout=900, layouts=LAYOUTS, names=list(VARIANTS))[0]


@pytest.mark.parametrize("key", list(LAYOUTS))
def test_memory_flags_keep_megatron_numerics(layouts, key):
    results = layouts[key]
    _check(results, list(VARIANTS))
    assert any("fine-grained-activation-offloading" in n for n in results["fine_grained"]["notices"])
