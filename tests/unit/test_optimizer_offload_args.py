"""--optimizer-cpu-offload's flag handling (hyper_adaptor/features/optimizer_offload.py: adjust, validate;
patches), one process. The served optimizer itself: tests/distributed/test_optimizer_offload_megatron.py."""

import pytest

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor.features import FeatureConfigError, get
from hyper_adaptor.features.base import restore_hidden
from hyper_adaptor.patch_manager import PatchManager
from hyper_adaptor.patches.memory import optimizer as optimizer_patches
from tests.unit.test_adaptor import megatron_args

optimizer = get("optimizer_offload")
HIDE = "--optimizer-cpu-offload: hidden from megatron's argument checks"


def _args(*flags):
    return megatron_args("--optimizer-cpu-offload", *flags)


def _adjust(args) -> list[str]:
    """The feature's notices after the one that says the flag is hidden from megatron's check."""
    notices = optimizer.adjust(args)
    assert notices[0].startswith(HIDE), notices
    return notices[1:]


def test_adjust_hides_the_flag_from_megatron_and_puts_it_back():
    args = _args()
    assert _adjust(args) == []
    # megatron's validate_args asserts --use-precision-aware-optimizer when it sees the flag
    assert args.optimizer_cpu_offload is False
    restore_hidden(args)
    assert args.optimizer_cpu_offload is True  # the OptimizerConfig megatron builds carries it to the seam


def test_megatrons_precision_aware_flag_given_along_is_switched_off_with_a_notice():
    args = _args("--use-precision-aware-optimizer")
    notices = _adjust(args)
    assert args.use_precision_aware_optimizer is False
    assert len(notices) == 1 and notices[0].startswith("--use-precision-aware-optimizer: True -> False")
    optimizer.validate(args)


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_precision_aware_flag_kept_where_megatrons_own_path_takes_it(precision):
    # the distributed optimizer in half precision: megatron's precision-aware path (no fp32 main copies
    # beside the parameters), served by the OffloadedHybridOptimizer patch
    args = _args("--use-precision-aware-optimizer", "--use-distributed-optimizer", precision)
    assert _adjust(args) == []
    assert args.use_precision_aware_optimizer is True
    optimizer.validate(args)


@pytest.mark.parametrize("flags", [("--use-distributed-optimizer",),             # fp32: nothing to keep apart
                                   ("--bf16",),                                   # megatron's path needs distopt
                                   ("--bf16", "--use-distributed-optimizer", "--optimizer", "sgd")])
def test_precision_aware_flag_switched_off_where_megatrons_path_cannot_take_it(flags):
    args = _args("--use-precision-aware-optimizer", *flags)
    notices = _adjust(args)
    assert args.use_precision_aware_optimizer is False
    assert notices[0].startswith("--use-precision-aware-optimizer: True -> False")
    # with the distributed optimizer in half precision the user also hears that its fp32 main shards stay
    # on the device (without it, the offload keeps megatron's fp32 main copies on the host itself)
    told = "--bf16" in flags and "--use-distributed-optimizer" in flags
    assert len(notices) == (2 if told else 1)
    if told:
        assert "fp32 main shards stay on the device" in notices[1]


@pytest.mark.parametrize("flags,told", [(("--bf16",), False), (("--bf16", "--use-distributed-optimizer"), True),
                                        (("--use-distributed-optimizer",), False)])
def test_half_precision_offload_without_megatrons_path_says_where_the_fp32_main_copies_stay(flags, told):
    notices = _adjust(_args(*flags))
    assert notices == ([] if not told else [notices[0]])
    if told:
        assert "--use-precision-aware-optimizer keeps them on the host only" in notices[0]


def test_without_the_flag_the_feature_is_off_and_nothing_changes():
    args = megatron_args("--use-precision-aware-optimizer")
    assert not optimizer.requested(args)
    adaptor_module.ADAPTOR.prepare(args, say=False)
    assert args.use_precision_aware_optimizer is True and args.optimizer_cpu_offload is False


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--optimizer-offload-fraction", "1.5"), r"--optimizer-offload-fraction must be in \[0, 1\] .*got 1.5"),
        (("--optimizer-offload-fraction", "-0.1"), r"--optimizer-offload-fraction must be in \[0, 1\] .*got -0.1"),
        (("--optimizer-offload-fraction", "nan"), r"--optimizer-offload-fraction must be in \[0, 1\] .*got nan"),
        (("--optimizer-offload-fraction", "inf"), r"--optimizer-offload-fraction must be in \[0, 1\] .*got inf"),
        (("--optimizer", "lion"), "--optimizer-cpu-offload serves --optimizer adam or sgd .*got --optimizer lion"),
        (("--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"), "--exp-avg-dtype bf16 .*cannot be served"),
        (("--main-params-dtype", "fp16"), "--main-params-dtype fp16"),
        (("--use-torch-fsdp2",), "--optimizer-cpu-offload cannot be combined with --use-torch-fsdp2"),
        (("--optimizer-cuda-graph",), "--optimizer-cpu-offload cannot be combined with --optimizer-cuda-graph"),
        (("--bf16", "--qk-clip"), "--qk-clip rewrites those copies on the device"),
    ],
)
def test_combinations_that_cannot_work_are_errors_naming_the_flags(flags, message):
    args = _args(*flags)
    optimizer.adjust(args)
    with pytest.raises(FeatureConfigError, match=message):
        optimizer.validate(args)


@pytest.mark.parametrize("fraction", ["0", "0.5", "1"])
def test_fractions_in_range_and_sgd_are_served(fraction):
    args = _args("--optimizer-offload-fraction", fraction, "--optimizer", "sgd")
    optimizer.adjust(args)
    optimizer.validate(args)


def test_through_the_adaptor_megatrons_command_line_passes_its_own_check():
    # the optimizer_offload feature's adjust / validate run; megatron's assertion (arguments.py:1803) sees the
    # flag lowered, so `--optimizer-cpu-offload --use-precision-aware-optimizer` (megatron's spelling)
    # and `--optimizer-cpu-offload` alone both get past it
    for extra in ((), ("--use-precision-aware-optimizer",)):
        args = _args(*extra)
        adaptor_module.ADAPTOR.prepare(args, say=False)
        assert args.optimizer_cpu_offload is False and args.use_precision_aware_optimizer is False
        restore_hidden(args)
        assert args.optimizer_cpu_offload is True


def test_the_seam_resolves_in_the_installed_megatron():
    manager = PatchManager()
    manager.register_all(optimizer_patches.patches(_args()))
    targets = [p.target for p in optimizer_patches.patches(_args())]
    float16 = optimizer_patches.FLOAT16
    assert targets == [optimizer_patches.FACTORY, optimizer_patches.HYBRID,
                       f"{float16}._get_model_and_main_params_data_float16",
                       f"{float16}._copy_model_params_to_main_params", f"{float16}.state_dict",
                       f"{float16}.load_state_dict", optimizer_patches.PARAM_DATA, optimizer_patches.PARAM_METADATA]
    with manager.applied():
        import megatron.core.optimizer as mco
        import megatron.core.optimizer.distrib_optimizer as distrib
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

        for name in ("_get_model_and_main_params_data_float16", "_copy_model_params_to_main_params", "state_dict",
                     "load_state_dict"):  # the four seams of released fp32 main copies
            assert getattr(Float16OptimizerWithFloat16Params, name).__wrapped__ is not None

        assert mco._get_megatron_optimizer_based_on_param_groups.__wrapped__ is not None
        # the class megatron's factory builds and its distributed optimizer checks for, in both places
        assert mco.HybridDeviceOptimizer is optimizer_patches.OffloadedHybridOptimizer
        assert distrib.HybridDeviceOptimizer is optimizer_patches.OffloadedHybridOptimizer
    assert mco.HybridDeviceOptimizer is not optimizer_patches.OffloadedHybridOptimizer
