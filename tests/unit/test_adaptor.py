"""The one-line import, flags, levels and bad input (one process)."""

import argparse
import subprocess
import sys
import sysconfig
from pathlib import Path

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
    assert ("--use-probe, --probe-exclusive (probe) is a level-2 feature but --optimization-level is 1: "
            "not applied") in out
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
        (("--use-fused-swiglu", "--swiglu", "--no-bias-swiglu-fusion"),
         "--use-fused-swiglu and --no-bias-swiglu-fusion"),
        (("--use-fused-swiglu",), "--use-fused-swiglu needs --swiglu"),
        (("--use-fused-rmsnorm",), "--use-fused-rmsnorm needs --normalization RMSNorm, got --normalization LayerNorm"),
        (("--use-fused-rotary-pos-emb", "--position-embedding-type", "learned_absolute"),
         "--use-fused-rotary-pos-emb needs --position-embedding-type rope"),
        (("--moe-grouped-gemm",), "--moe-grouped-gemm needs --num-experts"),
        (("--moe-grouped-gemm", "--num-experts", "-4"), "--num-experts must be >= 1 for --moe-grouped-gemm; got -4"),
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


# the feature contract itself, every feature's flags on: tests/unit/test_contract.py


def test_describe_shows_adjustments_and_marks_a_missing_target(monkeypatch):
    import io

    from hyper_adaptor import cli
    from hyper_adaptor.patch_manager import Patch

    hsdp = features.get("hsdp")
    real = hsdp.patches
    monkeypatch.setattr(hsdp, "patches", lambda args: real(args) + [
        Patch("megatron.core.optimizer.optimizer.NoSuchOptimizer.step", lambda o: o, "wrap", "hsdp")])
    out = io.StringIO()
    assert cli.describe(["--use-hsdp", "--fp16"], out=out) == 1
    text = out.getvalue()
    assert "adjustments to megatron's arguments:" in text and "--hsdp-reduce-dtype: None -> 'fp32'" in text
    assert "wrap    megatron.core.optimizer.optimizer.NoSuchOptimizer.step  MISSING: feature 'hsdp'" in text
    assert "1 patch target(s) MISSING in megatron-core 0.19.2" in text
    assert "wrap    megatron.training.checkpointing.generate_state_dict\n" in text  # a resolved one: unmarked


def test_every_level0_change_is_a_patch_that_undo_takes_back():
    """The Tensor.type view, the import shims, the RNG log patch and the environment variable all go
    through the manager: after undo() nothing of level 0 is left (a fresh process: level 0 is process-wide)."""
    code = """
import logging, os, sys, typing, torch
inherited = torch._C.TensorBase.type
import hyper_adaptor.megatron_adaptor as a
import megatron.core.tensor_parallel.random as rng
kinds = {p.kind for p in a.ADAPTOR.manager.patches}
assert {"replace", "wrap", "provide", "item"} <= kinds, kinds
assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and rng.logging is not logging
assert "type" in vars(torch.Tensor)
a.ADAPTOR.manager.undo()
assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
assert rng.logging is logging
assert "type" not in vars(torch.Tensor) and torch.Tensor.type is inherited
assert not hasattr(typing, "override")
assert "triton" not in sys.modules  # the stand-in megatron's paged stash imported is not left behind
assert not any(type(f).__name__ == "_StandInFinder" for f in sys.meta_path)
assert (not hasattr(torch.cuda.current_device, "__qualname__")
        or "emulated" not in torch.cuda.current_device.__qualname__)
print("clean")
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "clean" in result.stdout


def test_host_fork_warning_is_dropped_and_other_records_pass(caplog):
    import logging

    from hyper_adaptor.patches.compat.megatron_core import HOST_FORK_WARNING, RNG_MODULE

    import megatron.core.tensor_parallel.random as rng

    if ADAPTOR.device_type != "cpu":
        pytest.skip("a CPU patch")
    with caplog.at_level(logging.WARNING, logger=RNG_MODULE):
        rng.logging.getLogger(RNG_MODULE).warning(HOST_FORK_WARNING)
        rng.logging.getLogger(RNG_MODULE).warning("something else")
    messages = [r.getMessage() for r in caplog.records if r.name == RNG_MODULE]
    assert messages == ["something else"]


def test_megatron_builds_its_dataset_helpers_for_this_interpreter(monkeypatch):
    """A checkout's Makefile names the helpers by the python3-config on PATH, another interpreter's in a
    virtual environment or under a checkout's .python-version: the build gets this one's suffix and bin."""
    import importlib.util
    import os

    from hyper_adaptor.patches.compat import megatron_training

    seen = {}

    def make():
        seen.update(PATH=os.environ["PATH"], MAKEFLAGS=os.environ.get("MAKEFLAGS"))

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # the helpers are not built
    monkeypatch.setenv("MAKEFLAGS", "-j2")
    before = os.environ["PATH"]
    megatron_training._build_for_this_interpreter(make)()
    assert seen["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert seen["MAKEFLAGS"] == f"-j2 LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}"
    assert os.environ["PATH"] == before and os.environ["MAKEFLAGS"] == "-j2"


def test_unbuildable_dataset_helpers_are_said_before_megatron_tries(tmp_path, monkeypatch):
    """A checkout builds its dataset helpers with `python3 -m pybind11` from PATH at start-up; without
    pybind11 every rank would die in a compiler error / gloo cascade. validate says so first."""
    from hyper_adaptor.patches.compat import megatron_training

    datasets = tmp_path / "datasets"
    datasets.mkdir()
    (datasets / "helpers.cpp").write_text("")
    no_pybind = tmp_path / "bin" / "python3"
    no_pybind.parent.mkdir()
    no_pybind.write_text("#!/bin/sh\necho 'No module named pybind11' >&2\nexit 1\n")
    no_pybind.chmod(0o755)

    assert "no Makefile" in megatron_training.dataset_helpers_problem(datasets, str(no_pybind))
    (datasets / "Makefile").write_text("default:\n")
    problem = megatron_training.dataset_helpers_problem(datasets, str(no_pybind))
    assert f"`{no_pybind} -m pip install pybind11`" in problem and "No module named pybind11" in problem
    assert f"make -C {datasets}" in problem
    # built for another Python (megatron's make followed a python3-config that is not this interpreter's)
    other = datasets / "helpers_cpp.cpython-39-x86_64-linux-gnu.so"
    other.write_text("")
    problem = megatron_training.dataset_helpers_problem(datasets, str(no_pybind))
    assert "built for another Python" in problem and other.name in problem and "remove them" in problem
    other.unlink()
    ours = datasets / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    ours.write_text("")
    assert megatron_training.dataset_helpers_problem(datasets, str(no_pybind)) is None
    ours.unlink()

    monkeypatch.setattr(megatron_training, "_datasets_dir", lambda: datasets)
    monkeypatch.setattr(megatron_training, "_python3_for_make", lambda: str(no_pybind))
    with pytest.raises(FeatureConfigError, match="pip install pybind11"):
        ADAPTOR.prepare(megatron_args())
