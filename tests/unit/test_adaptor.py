"""The one-line import, flags, levels and bad input (one process)."""

import argparse
import subprocess
import sys
import types

import pytest
import torch

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor import features
from hyper_adaptor.features import Feature, FeatureConfigError, Flag

ADAPTOR = adaptor_module.ADAPTOR


def run_python(code: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)


def test_plain_import_does_not_import_megatron():
    result = run_python("import sys, hyper_adaptor; print(any(m.startswith('megatron') for m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_one_line_import_makes_megatron_importable_on_this_python():
    code = (
        "import torch, hyper_adaptor.megatron_adaptor\n"
        "import megatron.core, megatron.training, megatron.training.training\n"
        "print('imported')"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "imported" in result.stdout


def megatron_args(*flags: str) -> argparse.Namespace:
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser.parse_args(list(flags))


def test_megatron_parser_gets_the_adaptor_flags():
    args = megatron_args("--optimization-level", "1", "--device-type", "cpu")
    assert args.optimization_level == 1 and args.device_type == "cpu"
    assert megatron_args().optimization_level == 2  # default: level 2


def test_unknown_optimization_level_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        megatron_args("--optimization-level", "3")
    assert "--optimization-level" in capsys.readouterr().err


def test_adapt_rejects_unknown_level_without_argparse():
    args = megatron_args()
    args.optimization_level = 5
    with pytest.raises(FeatureConfigError, match="--optimization-level must be 0, 1 or 2; got 5"):
        adaptor_module.adapt(args)


class _Probe(Feature):
    """A level-2 feature with two flags that exclude each other, to exercise the contract."""

    name = "probe"
    level = 2
    flags = (Flag("--use-probe", "test switch"), Flag("--probe-exclusive", "conflicts with --use-probe"))

    def validate(self, args):
        if args.use_probe and args.probe_exclusive:
            raise FeatureConfigError("--use-probe and --probe-exclusive cannot be combined")


@pytest.fixture
def probe_feature(monkeypatch):
    probe = _Probe()
    monkeypatch.setattr(adaptor_module, "FEATURES", adaptor_module.FEATURES + (probe,))
    monkeypatch.setattr(features, "FEATURES", features.FEATURES + (probe,))
    return probe


def test_feature_flag_above_level_is_a_notice_naming_the_flag_and_level(probe_feature, capsys):
    args = megatron_args("--use-probe", "--optimization-level", "1")
    ADAPTOR.prepare(args)
    out = capsys.readouterr().out
    assert "--use-probe, --probe-exclusive (probe) is a level-2 feature but --optimization-level is 1: not applied" in out
    assert not probe_feature.is_enabled(args)
    ADAPTOR.prepare(megatron_args("--optimization-level", "1"))
    assert "probe" not in capsys.readouterr().out  # not asked for: nothing said


def test_conflicting_flags_are_an_error_naming_both(probe_feature):
    args = megatron_args("--use-probe", "--probe-exclusive")
    with pytest.raises(FeatureConfigError, match="--use-probe and --probe-exclusive"):
        ADAPTOR.prepare(args)


def test_level_gating(probe_feature):
    assert probe_feature.is_enabled(megatron_args("--use-probe"))
    assert not probe_feature.is_enabled(megatron_args())
    assert not probe_feature.is_enabled(megatron_args("--use-probe", "--optimization-level", "0"))  # prepare says so
    compat = features.get("compat")
    assert compat.is_enabled(megatron_args("--optimization-level", "0"))  # level 0 always applies


def test_adapt_fills_missing_flags_and_is_idempotent():
    args = argparse.Namespace(distributed_backend="nccl", transformer_impl="local")
    adaptor_module.adapt(args)
    patches_after_first = len(ADAPTOR.manager.patches)
    adaptor_module.adapt(args)
    assert len(ADAPTOR.manager.patches) == patches_after_first
    assert args.optimization_level == 2 and args.device_type == "auto"
    assert args.distributed_backend == "gloo"  # switched on the cpu platform, with a notice
    # wrapped once, not twice
    assert not hasattr(torch.empty.__wrapped__, "__wrapped__")


def test_device_type_mismatch_with_the_import_choice_is_an_error():
    args = megatron_args("--device-type", "cuda")
    with pytest.raises(FeatureConfigError, match="--device-type cuda differs"):
        ADAPTOR.prepare(args)


def test_requesting_cuda_on_a_cpu_machine_fails_at_import():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = run_python("import torch, hyper_adaptor.megatron_adaptor", "--device-type", "cuda")
    assert result.returncode != 0
    assert "--device-type cuda was requested" in result.stderr


@pytest.mark.parametrize("version", ["0.18.0", "0.20.0"])
def test_unsupported_megatron_core_version_is_an_error(version):
    with pytest.raises(RuntimeError, match=rf"supports megatron-core 0\.19\.2; the installed megatron-core is {version}"):
        adaptor_module.check_megatron_version(version)


def test_missing_megatron_core_is_an_error(monkeypatch):
    monkeypatch.setattr(adaptor_module, "megatron_core_version", lambda: None)
    with pytest.raises(RuntimeError, match="it is not installed"):
        adaptor_module.check_megatron_version()


def test_platform_defaults_are_switched_with_one_notice_each(capsys):
    args = megatron_args("--optimization-level", "0")  # Megatron's own defaults: nccl, TE, fusions on
    ADAPTOR.prepare(args)
    out = capsys.readouterr().out
    assert args.distributed_backend == "gloo" and args.transformer_impl == "local"
    assert args.no_persist_layer_norm and not args.gradient_accumulation_fusion
    assert not args.masked_softmax_fusion and not args.apply_rope_fusion
    for flag in ("--distributed-backend", "--transformer-impl", "--gradient-accumulation-fusion"):
        assert out.count(flag) == 1


def test_gradient_accumulation_fusion_stays_on_from_level_1():
    """From level 1 hyper_adaptor serves the fused wgrad kernel itself, so Megatron's default stays."""
    args = megatron_args("--optimization-level", "1")
    ADAPTOR.prepare(args)
    assert args.gradient_accumulation_fusion
    assert features.get("grad_accum_fusion").is_enabled(args)
    args = megatron_args("--optimization-level", "1", "--no-gradient-accumulation-fusion")
    ADAPTOR.prepare(args)
    assert not features.get("grad_accum_fusion").is_enabled(args)


def test_describe_lists_features_and_targets():
    result = subprocess.run(
        [sys.executable, "-m", "hyper_adaptor", "describe", "--tensor-model-parallel-size", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[x] compat  (level 0)" in result.stdout
    assert "replace torch.cuda.current_device" in result.stdout
    assert "megatron.core.tensor_parallel.random._set_cuda_rng_state" in result.stdout
    assert "wrap    megatron.training.arguments.validate_args" in result.stdout


def test_describe_reports_bad_level():
    result = subprocess.run(
        [sys.executable, "-m", "hyper_adaptor", "describe", "--optimization-level", "9"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0 and "--optimization-level" in result.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--use-fused-swiglu", "--swiglu", "--no-bias-swiglu-fusion"), "--use-fused-swiglu and --no-bias-swiglu-fusion"),
        (("--use-fused-swiglu",), "--use-fused-swiglu needs --swiglu"),
        (("--use-fused-rmsnorm",), "--use-fused-rmsnorm needs --normalization RMSNorm, got --normalization LayerNorm"),
        (("--use-fused-rotary-pos-emb", "--position-embedding-type", "learned_absolute"),
         "--use-fused-rotary-pos-emb needs --position-embedding-type rope"),
    ],
)
def test_level1_flag_conflicts_name_the_flags(flags, message):
    with pytest.raises(FeatureConfigError, match=message):
        ADAPTOR.prepare(megatron_args("--optimization-level", "1", *flags))


def test_level1_flags_refuse_transformer_engine_impl(monkeypatch):
    from hyper_adaptor.patches.compat import arguments

    monkeypatch.setattr(arguments, "have_transformer_engine", lambda: True)  # TE present: not switched
    with pytest.raises(FeatureConfigError, match="--use-flash-attn .*--transformer-impl is 'transformer_engine'"):
        ADAPTOR.prepare(megatron_args("--use-flash-attn"))


def test_unknown_fused_backend_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        megatron_args("--fused-backend", "cuda")
    assert "--fused-backend" in capsys.readouterr().err
