"""The memory feature's flag handling (features/memory.py): what adjust changes, what validate refuses
(naming the flags), and the plan it builds. Parity of each flag: tests/distributed/test_memory_megatron.py."""

import types

import pytest

import hyper_adaptor.megatron_adaptor  # noqa: F401
from hyper_adaptor.features import FeatureConfigError, base, get

MEMORY = get("memory")


def _args(**flags):
    args = types.SimpleNamespace(optimization_level=2, num_layers=4, recompute_granularity=None,
                                 recompute_modules=None, offload_modules=[], fine_grained_activation_offloading=False,
                                 cpu_offloading_num_layers=0, use_hsdp=False, min_offloaded_tensor_size=1 << 20)
    MEMORY.fill_defaults(args)
    vars(args).update(flags)
    return args


def _prepared(**flags):
    args = _args(**flags)
    notices = MEMORY.adjust(args)
    MEMORY.validate(args)
    return args, notices


def test_not_requested_without_a_flag():
    assert not MEMORY.requested(_args())
    assert MEMORY.requested(_args(swap_attention=True)) and MEMORY.requested(_args(cpu_offloading_num_layers=2))


def test_cpu_offloading_is_hidden_from_megatron_and_served_by_the_plan():
    args, _ = _prepared(cpu_offloading_num_layers=2)
    assert args.cpu_offloading_num_layers is False  # what megatron's validate_args sees
    assert MEMORY.requested(args)
    base.restore_hidden(args)
    assert args.cpu_offloading_num_layers == 2 and MEMORY.make_plan(args).swap_first_layers == 2


def test_fine_grained_offloading_is_switched_off_for_megatron_and_swapped_here():
    args, notices = _prepared(fine_grained_activation_offloading=True, offload_modules=["core_attn", "attn_proj"])
    assert args.fine_grained_activation_offloading is False and args.offload_modules == []
    assert any("--fine-grained-activation-offloading: True -> False" in n for n in notices)
    assert MEMORY.requested(args) and MEMORY.make_plan(args).swap == ("core_attn", "attn_proj")


def test_recompute_norm_is_megatrons_selective_layernorm():
    args, notices = _prepared(recompute_norm=True)
    assert args.recompute_granularity == "selective" and args.recompute_modules == ["layernorm"]
    args, _ = _prepared(recompute_norm=True, recompute_granularity="selective", recompute_modules=["core_attn"])
    assert args.recompute_modules == ["core_attn", "layernorm"]


def test_plan_from_flags():
    plan = MEMORY.make_plan(_args(swap_attention=True, swap_modules=["mlp"], swap_prefetch_layers=0,
                                  min_offloaded_tensor_size=0, recompute_activation_function=False))
    assert plan.swap == ("mlp", "self_attn") and plan.prefetch == 0 and plan.min_bytes == 0


@pytest.mark.parametrize("flags,names", [
    (dict(swap_attention=True, recompute_granularity="full"), "--recompute-granularity full"),
    (dict(swap_modules=["layer", "mlp"]), "--swap-modules layer"),
    (dict(swap_attention=True, swap_modules=["core_attn"]), "--swap-modules self_attn"),
    (dict(swap_modules=["core_attn"], recompute_granularity="selective", recompute_modules=["core_attn"]),
     "--recompute-modules"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["moe_act"]), "--offload-modules moe_act"),
    (dict(fine_grained_activation_offloading=True, offload_modules=[]), "--offload-modules"),
    (dict(swap_attention=True, swap_prefetch_layers=-1), "--swap-prefetch-layers"),
    (dict(cpu_offloading_num_layers=5), "--cpu-offloading-num-layers"),
    (dict(recompute_activation_function=True, swap_modules=["mlp"]), "--recompute-activation-function"),
    (dict(recompute_activation_function=True, recompute_granularity="full"), "--recompute-activation-function"),
    (dict(recompute_norm=True, recompute_granularity="full"), "--recompute-norm"),
])
def test_combinations_that_cannot_work_are_refused_by_name(flags, names):
    with pytest.raises(FeatureConfigError, match=names.replace("-", r"\-")):
        _prepared(**flags)
