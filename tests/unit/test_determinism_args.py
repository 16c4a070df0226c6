"""--deterministic-mode: served by the adaptor (hidden from megatron's own set-up), refusals naming the
flag or variable, the device's environment as item patches (listed, undone), the fused ops' choice of
deterministic kernels and their refusal (one process; the runs are in tests/e2e/test_determinism.py)."""

import os
import types

import pytest
import torch

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor import features, platform
from hyper_adaptor.features import FeatureConfigError
from hyper_adaptor.features.base import asked, restore_hidden
from hyper_adaptor.ops import backend
from hyper_adaptor.patch_manager import PatchManager
from hyper_adaptor.patches import determinism
from tests.unit.test_adaptor import megatron_args

ADAPTOR = adaptor_module.ADAPTOR
MODEL = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "1")
DEVICE_ENV = [name for env in determinism.ENV.values() for name in env] + ["MAMBA_DETERMINISTIC"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in DEVICE_ENV:
        monkeypatch.delenv(name, raising=False)


def _prepare(*flags):
    args = megatron_args(*MODEL, *flags)
    args.rank, args.world_size = 0, 1
    ADAPTOR.prepare(args, say=False)
    return args


def test_requested_at_every_level_and_hidden_from_megatrons_own_set_up():
    feature = features.get("determinism")
    assert not feature.is_enabled(_prepare())
    for level in ("0", "1", "2"):
        args = _prepare("--deterministic-mode", "--optimization-level", level)
        # megatron's validate_args sees False (its set-up writes CUDA variables outside the patch manager) ...
        assert args.deterministic_mode is False and asked(args, "deterministic_mode") is True
        assert feature.is_enabled(args)
        # ... and everything built after it (the model config) sees the flag as given
        restore_hidden(args)
        assert args.deterministic_mode is True


@pytest.mark.parametrize("flag, message", [
    ("--cross-entropy-loss-fusion", "cannot be combined with --cross-entropy-loss-fusion"),
    ("--tp-comm-overlap", "cannot be combined with --tp-comm-overlap"),
])
def test_megatrons_refusals_name_the_flag(flag, message):
    with pytest.raises(FeatureConfigError, match=message):
        _prepare("--deterministic-mode", flag)


@pytest.mark.parametrize("device, env, problem", [
    ("cuda", {"NCCL_ALGO": "Tree"}, "NCCL_ALGO='Tree'"),
    ("cuda", {"NCCL_ALGO": "Ring,NVLS"}, "NCCL_ALGO='Ring,NVLS'"),
    ("cuda", {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, "CUBLAS_WORKSPACE_CONFIG=':0:0'"),
    ("cuda", {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}, "NVTE_ALLOW_NONDETERMINISTIC_ALGO='1'"),
    ("cuda", {"MAMBA_DETERMINISTIC": "0"}, "MAMBA_DETERMINISTIC='0'"),
    ("npu", {"HCCL_DETERMINISTIC": "false"}, "HCCL_DETERMINISTIC='false'"),
])
def test_a_nondeterministic_environment_is_refused_naming_the_variable(monkeypatch, device, env, problem):
    assert problem in "; ".join(determinism.env_problems(device, env))
    monkeypatch.setattr(platform, "device_type", lambda: device)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(FeatureConfigError, match=f"--deterministic-mode on {device}.*{problem}"):
        _prepare("--deterministic-mode")


@pytest.mark.parametrize("device, env", [
    ("cuda", {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":16:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}),
    ("cuda", {"NCCL_ALGO": "CollnetDirect,CollnetChain"}),
    ("npu", {"HCCL_DETERMINISTIC": "strict"}),
    ("npu", {"HCCL_DETERMINISTIC": "TRUE"}),
    ("cpu", {"NCCL_ALGO": "Tree", "HCCL_DETERMINISTIC": "false"}),  # not this device's libraries
])
def test_deterministic_settings_a_launcher_made_are_accepted(device, env):
    assert determinism.env_problems(device, env) == []


def test_each_devices_variables_are_item_patches_listed_and_undone(monkeypatch):
    monkeypatch.setattr(platform, "device_type", lambda: "cuda")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the launcher's deterministic choice is kept
    patches = features.get("determinism").patches(_prepare("--deterministic-mode"))
    targets = {p.target: (p.kind, p.replacement) for p in patches}
    assert targets == {
        "os.environ.NCCL_ALGO": ("item", "Ring"),
        "os.environ.NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("item", "0"),
        "hyper_adaptor.ops.backend.DETERMINISTIC": ("replace", True),
    }
    manager = PatchManager()
    manager.register_all(patches)
    with manager.applied():
        assert os.environ["NCCL_ALGO"] == "Ring" and os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and backend.DETERMINISTIC is True
    assert "NCCL_ALGO" not in os.environ and "NVTE_ALLOW_NONDETERMINISTIC_ALGO" not in os.environ
    assert backend.DETERMINISTIC is False
    npu = {p.target for p in determinism.patches("npu")}
    assert npu == {"os.environ.HCCL_DETERMINISTIC", "hyper_adaptor.ops.backend.DETERMINISTIC"}
    assert {p.target for p in determinism.patches("cpu")} == {"hyper_adaptor.ops.backend.DETERMINISTIC"}


def test_torch_switch_is_strict():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        assert determinism.switch_on("cpu") == ["torch.use_deterministic_algorithms(True)"]
        state = determinism.switches_state("cpu")
        assert state["torch_deterministic"] and not state["torch_warn_only"]
    finally:
        torch.use_deterministic_algorithms(before)


# ------------------------------------------------------------------------------------------ fused ops
def _op(name, fast_why=None, eager_why=None):
    return backend.Op(name, fast=backend.Impl(lambda x: "fast", nondeterministic=lambda x: fast_why),
                      eager=backend.Impl(lambda x: "eager", nondeterministic=lambda x: eager_why))


def test_ops_skip_a_nondeterministic_kernel_with_a_notice(monkeypatch, capsys):
    op = _op("det_test_skip", fast_why="atomics in its backward")
    assert op(0, backend="fast") == "fast"  # not asked outside deterministic mode
    monkeypatch.setattr(backend, "DETERMINISTIC", True)
    assert op(0, backend="fast") == "eager"
    assert "det_test_skip: the fast backend cannot serve this call (not deterministic under " \
           "--deterministic-mode: atomics in its backward); using eager" in capsys.readouterr().out


def test_an_op_without_a_deterministic_kernel_refuses_naming_the_op(monkeypatch):
    op = _op("det_test_refuse", fast_why="split-K", eager_why="index_add on this device")
    monkeypatch.setattr(backend, "DETERMINISTIC", True)
    with pytest.raises(backend.NondeterministicOpError,
                       match=r"det_test_refuse: --deterministic-mode.*fast: split-K; eager: index_add"):
        op(0, backend="fast")


def test_the_adaptors_kernels_that_are_not_deterministic(monkeypatch):
    from hyper_adaptor.ops import grouped_gemm, wgrad_accum

    assert "npu_grouped_matmul" in grouped_gemm.grouped_gemm_op.impls["npu"].nondeterministic()
    assert "npu_grouped_matmul_add_" in wgrad_accum.WGRAD_ACCUM.impls["npu"].nondeterministic()
    for op in (grouped_gemm.grouped_gemm_op, wgrad_accum.WGRAD_ACCUM):
        assert all(op.impls[b].nondeterministic() is None for b in ("fast", "eager"))
    # on CUDA the fast grouped GEMM is a loop of cuBLAS GEMMs, not torch's grouped_mm
    x = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    monkeypatch.setattr(grouped_gemm, "_aligned_for_torch_grouped_mm", lambda x, w: True)
    assert grouped_gemm._fast_kernels(x, None) is grouped_gemm.TORCH_GROUPED
    monkeypatch.setattr(backend, "DETERMINISTIC", True)
    assert grouped_gemm._fast_kernels(x, None) is grouped_gemm.LOOP
    cpu = types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"))
    assert grouped_gemm._fast_kernels(cpu, None) is grouped_gemm.TORCH_GROUPED
