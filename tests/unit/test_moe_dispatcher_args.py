"""``--moe-token-dispatcher-type flex`` without its backend: one FeatureConfigError at argument
validation naming the flags and the backend, on every device; ``alltoall`` / ``allgather`` untouched."""

from __future__ import annotations

import types

import pytest

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor.features import FeatureConfigError
from hyper_adaptor.patches.compat import moe_dispatchers
from tests.unit.test_adaptor import megatron_args

EP = ("--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2")


def _validate(*flags):
    args = megatron_args(*EP, *flags)
    args.world_size = 2
    adaptor_module.ADAPTOR.prepare(args)
    return args


@pytest.mark.parametrize("backend, names", [
    ((), "DeepEP \\(deep_ep.Buffer\\)"),
    (("--moe-flex-dispatcher-backend", "deepep"), "DeepEP \\(deep_ep.Buffer\\)"),
    (("--moe-flex-dispatcher-backend", "hybridep"), "HybridEP \\(deep_ep.HybridEPBuffer\\)"),
    (("--moe-flex-dispatcher-backend", "ncclep"), "TransformerEngine NCCL EP \\(transformer_engine.pytorch.ep\\)"),
])
def test_flex_on_cpu_is_an_error_naming_flag_and_backend(backend, names):
    chosen = backend[1] if backend else "deepep"
    message = (f"--moe-token-dispatcher-type flex with --moe-flex-dispatcher-backend {chosen} needs {names}, "
               "CUDA kernels that do not run on cpu; use --moe-token-dispatcher-type alltoall or allgather")
    with pytest.raises(FeatureConfigError, match=message):
        _validate("--moe-token-dispatcher-type", "flex", *backend)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_megatrons_own_dispatchers_pass(dispatcher):
    args = _validate("--moe-token-dispatcher-type", dispatcher)
    assert args.moe_token_dispatcher_type == dispatcher


def test_on_cuda_the_backend_must_import():
    args = types.SimpleNamespace(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                                 moe_enable_deepep=False)
    asked = []

    def missing(module, name):
        asked.append((module, name))
        return False

    problem = moe_dispatchers.flex_backend_problem(args, "cuda", can_import=missing)
    assert asked == [("deep_ep", "HybridEPBuffer")]
    assert problem.startswith("--moe-token-dispatcher-type flex with --moe-flex-dispatcher-backend hybridep needs "
                              "HybridEP (deep_ep.HybridEPBuffer), which this Python cannot import; install it")
    assert moe_dispatchers.flex_backend_problem(args, "cuda", can_import=lambda m, n: True) is None
    # megatron's older switch picks DeepEP whatever the backend flag says
    args.moe_enable_deepep = True
    assert "backend deepep needs DeepEP" in moe_dispatchers.flex_backend_problem(args, "npu", can_import=missing)
    # an unknown backend is megatron's to refuse
    args.moe_enable_deepep, args.moe_flex_dispatcher_backend = False, "other"
    assert moe_dispatchers.flex_backend_problem(args, "cpu") is None


def test_importable_reads_module_and_name():
    assert moe_dispatchers.importable("json", "dumps")
    assert not moe_dispatchers.importable("json", "no_such_name")
    assert not moe_dispatchers.importable("hyper_adaptor_no_such_module", None)
