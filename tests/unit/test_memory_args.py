"""The memory features' flag handling (features/swap.py, features/recompute.py): what adjust changes, what
validate refuses (naming the flags), and the plan the swap patch carries. Parity of each flag:
tests/distributed/test_memory_megatron.py. Optimizer offload: test_optimizer_offload_args.py."""

import types

import pytest

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor.features import FeatureConfigError, base, get, swap
from hyper_adaptor.patches.memory import layers
from tests.unit.test_adaptor import megatron_args

SWAP, RECOMPUTE = get("swap"), get("recompute")


def _args(**flags):
    args = types.SimpleNamespace(optimization_level=2, num_layers=4, recompute_granularity=None,
                                 recompute_modules=None, offload_modules=[], fine_grained_activation_offloading=False,
                                 cpu_offloading_num_layers=0, use_hsdp=False, min_offloaded_tensor_size=1 << 20)
    SWAP.fill_defaults(args)
    RECOMPUTE.fill_defaults(args)
    vars(args).update(flags)
    return args


def _prepared(**flags):
    """adjust then validate of both features, as the adaptor runs them (in FEATURES order)."""
    args = _args(**flags)
    notices = []
    for feature in (SWAP, RECOMPUTE):
        if feature.requested(args):
            notices += feature.adjust(args)
    for feature in (SWAP, RECOMPUTE):
        if feature.requested(args):
            feature.validate(args)
    return args, notices


def test_not_requested_without_a_flag():
    assert not SWAP.requested(_args()) and not RECOMPUTE.requested(_args())
    assert SWAP.requested(_args(swap_attention=True)) and SWAP.requested(_args(cpu_offloading_num_layers=2))
    assert SWAP.requested(_args(fine_grained_activation_offloading=True))
    assert RECOMPUTE.requested(_args(recompute_norm=True)) and not SWAP.requested(_args(recompute_norm=True))


def test_cpu_offloading_is_hidden_from_megatron_with_a_notice_and_served_by_the_plan():
    args, notices = _prepared(cpu_offloading_num_layers=2)
    assert args.cpu_offloading_num_layers is False  # what megatron's validate_args sees
    assert [n for n in notices if n.startswith("--cpu-offloading-num-layers: hidden from megatron")] == notices
    assert SWAP.requested(args)
    base.restore_hidden(args)
    assert args.cpu_offloading_num_layers == 2 and swap.make_plan(args).swap_first_layers == 2


def test_fine_grained_offloading_is_taken_from_megatron_and_swapped_here():
    args, notices = _prepared(fine_grained_activation_offloading=True, offload_modules=["core_attn", "attn_proj"])
    assert args.fine_grained_activation_offloading is False and args.offload_modules == []
    assert any("--fine-grained-activation-offloading: True -> False" in n for n in notices)
    assert any(n.startswith("--offload-modules: ['core_attn', 'attn_proj'] -> []") for n in notices)
    base.restore_hidden(args)  # taken for the run: megatron's own offload code must not run
    assert args.fine_grained_activation_offloading is False
    assert SWAP.requested(args) and swap.make_plan(args).swap == ("core_attn", "attn_proj")


def test_fine_grained_offloading_without_modules_is_the_documented_error_through_the_adaptor():
    args = megatron_args("--fine-grained-activation-offloading")
    with pytest.raises(FeatureConfigError, match="--fine-grained-activation-offloading needs --offload-modules"):
        adaptor_module.ADAPTOR.prepare(args, say=False)


def test_recompute_norm_is_megatrons_selective_layernorm():
    args, notices = _prepared(recompute_norm=True)
    assert args.recompute_granularity == "selective" and args.recompute_modules == ["layernorm"]
    assert len(notices) == 2
    args, _ = _prepared(recompute_norm=True, recompute_granularity="selective", recompute_modules=["core_attn"])
    assert args.recompute_modules == ["core_attn", "layernorm"]


def test_plan_from_flags_and_the_patches_carry_it():
    args = _args(swap_attention=True, swap_modules=["mlp"], swap_prefetch_layers=0, min_offloaded_tensor_size=0)
    plan = swap.make_plan(args)
    assert plan.swap == ("mlp", "self_attn") and plan.prefetch == 0 and plan.min_bytes == 0
    assert not plan.recompute_activation
    patches = SWAP.patches(args)
    assert [(p.target, p.feature) for p in patches] == [(layers.BLOCK_INIT, "swap")]
    assert layers.plan_of(patches) == plan and layers.plan_of(SWAP.patches(args)) is not layers.plan_of(patches)


def test_swap_and_recompute_wrap_the_block_constructor_together():
    from hyper_adaptor.patch_manager import PatchManager

    args, _ = _prepared(swap_attention=True, recompute_activation_function=True)
    patches = SWAP.patches(args) + RECOMPUTE.patches(args)
    assert [p.feature for p in patches] == ["swap", "recompute"] and patches[1].after == ("swap",)
    assert layers.plan_of(RECOMPUTE.patches(args)).recompute_activation
    PatchManager().register_all(patches)  # no conflict: recompute's wrap is declared after swap's


@pytest.mark.parametrize("flags,names", [
    (dict(swap_attention=True, recompute_granularity="full"), "--recompute-granularity full"),
    (dict(swap_modules=["layer", "mlp"]), "--swap-modules layer"),
    (dict(swap_attention=True, swap_modules=["core_attn"]), "--swap-modules self_attn"),
    (dict(swap_modules=["core_attn"], recompute_granularity="selective", recompute_modules=["core_attn"]),
     "--recompute-modules"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["moe_act"]), "--offload-modules moe_act"),
    (dict(fine_grained_activation_offloading=True, offload_modules=[]), "--offload-modules"),
    (dict(fine_grained_activation_offloading=True, offload_modules=None), "--offload-modules"),
    (dict(swap_attention=True, swap_prefetch_layers=-1), "--swap-prefetch-layers"),
    (dict(swap_prefetch_layers=-2), "--swap-prefetch-layers must be >= 0; got -2"),
    (dict(cpu_offloading_num_layers=5), "--cpu-offloading-num-layers"),
    (dict(cpu_offloading_num_layers=-1), r"--cpu-offloading-num-layers must be in \[0, --num-layers=4\]; got -1"),
    (dict(swap_attention=True, min_offloaded_tensor_size=-1), "--min-offloaded-tensor-size must be >= 0"),
    (dict(recompute_activation_function=True, swap_modules=["mlp"]), "--recompute-activation-function"),
    (dict(recompute_activation_function=True, cpu_offloading_num_layers=1), "--recompute-activation-function"),
    (dict(recompute_activation_function=True, recompute_granularity="full"), "--recompute-activation-function"),
    (dict(recompute_norm=True, recompute_granularity="full"), "--recompute-norm"),
])
def test_combinations_that_cannot_work_are_refused_by_name(flags, names):
    with pytest.raises(FeatureConfigError, match=names if "\\" in names else names.replace("-", r"\-")):
        _prepared(**flags)
