"""Level-0 patches on megatron.training: start-up on a process without CUDA, and host-side RNG.

Argument defaults that cannot work on the platform are switched in ``arguments.py`` (of this
package), before megatron validates them; the patches here are the run-time seams.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import shutil
import subprocess
from pathlib import Path

import torch

from hyper_adaptor.patch_manager import Patch

FEATURE = "compat"
logger = logging.getLogger("hyper_adaptor.compat")


def _allow_host_only(original):
    """``initialize_megatron`` asserts CUDA unless told ``allow_no_cuda``; on the CPU platform the
    emulated device is the host, so tell it."""

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize


def _skip_make_when_prebuilt(original):
    """Rank 0 runs ``make`` to build the dataset helpers, but the megatron-core wheel ships them
    prebuilt and no Makefile: building fails on every platform. Build only when they are missing."""

    @functools.wraps(original)
    def compile_helpers(*args, **kwargs):
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
            logger.info("megatron dataset helpers are prebuilt in the wheel; not running make")
            return None
        return original(*args, **kwargs)

    return compile_helpers


def _datasets_dir() -> Path | None:
    spec = importlib.util.find_spec("megatron.core.datasets")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def dataset_helpers_problem(datasets_dir: Path | None = None, python3: str | None = None) -> str | None:
    """None when megatron's dataset helpers are built or can be; else what is wrong and the fix.

    A Megatron-LM checkout has no prebuilt ``helpers_cpp``: rank 0 runs ``make`` in
    megatron/core/datasets at start-up, whose Makefile asks ``python3 -m pybind11 --includes`` of the
    ``python3`` on PATH. Without pybind11 there every rank dies: rank 0 with a compiler error, the
    others with a gloo "connection closed" cascade. Said here, on every rank, before megatron tries."""
    datasets_dir = datasets_dir or _datasets_dir()
    if datasets_dir is None or any(datasets_dir.glob("helpers_cpp*.so")) or any(datasets_dir.glob("helpers_cpp*.pyd")):
        return None
    where = f"megatron's dataset helpers ({datasets_dir}/helpers.cpp) are not built"
    if not (datasets_dir / "Makefile").is_file():
        return f"{where} and there is no Makefile to build them with; reinstall megatron-core or use a full checkout"
    python3 = python3 or shutil.which("python3")
    if python3 is None:
        return f"{where}, and megatron builds them with `python3 -m pybind11`, but there is no python3 on PATH"
    try:
        probe = subprocess.run([python3, "-m", "pybind11", "--includes"], capture_output=True, text=True, timeout=120)
        failed = probe.returncode != 0
        why = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    except (OSError, subprocess.TimeoutExpired) as error:
        failed, why = True, repr(error)
    if not failed:
        return None
    return (f"{where}, and megatron cannot build them at start-up: `python3 -m pybind11` fails for the "
            f"python3 on PATH ({python3}: {why}). Fix: `{python3} -m pip install pybind11` (megatron's "
            f"Makefile uses that python3), or build them once with `make -C {datasets_dir}`")


_BIAS_FUSIONS = ("bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion")


def _warm_up_without_moving_host_rng(original):
    """The JIT warm-up draws random inputs on the device with shapes that depend on the TP size. On a
    GPU that moves the CUDA generator only; on the host platform it would move the generator that
    ``--use-cpu-initialization`` initialises weights from, so TP1 and TP2 would start from
    different weights. Run it with the host RNG state saved and restored."""

    @functools.wraps(original)
    def warm_up(*args, **kwargs):
        from megatron.training import global_vars

        margs = global_vars._GLOBAL_ARGS  # None before parse_args; then megatron's own call decides
        if margs is not None and not any(getattr(margs, f, False) for f in _BIAS_FUSIONS):
            # The warm-up compiles the fused bias kernels ahead of time; with every bias fusion off
            # none of them is used, and on the host that compile costs tens of seconds.
            logger.info("bias fusions are off: skipping megatron's JIT warm-up")
            return None
        with torch.random.fork_rng(devices=[]):
            return original(*args, **kwargs)

    return warm_up


def _host_generator_for_data_loader(original):
    """Starting a DataLoader iterator draws a seed from the default generator. On a GPU that is the
    host generator, which dropout never reads; on the host platform it is the one dropout reads, so a
    resumed run (which creates its iterator after restoring RNG state) would drift from the
    uninterrupted one. Give the loader a generator of its own, seeded from ``--seed``."""

    @functools.wraps(original)
    def build(*args, **kwargs):
        loader = original(*args, **kwargs)
        if isinstance(loader, torch.utils.data.DataLoader) and loader.generator is None:
            from megatron.training import get_args

            loader.generator = torch.Generator().manual_seed(int(get_args().seed))
        return loader

    return build


def patches(device_type: str) -> list[Patch]:
    result = [
        Patch("megatron.core.datasets.utils.compile_helpers", _skip_make_when_prebuilt, "wrap", FEATURE),
    ]
    if device_type == "cpu":
        result += [
            Patch("megatron.training.initialize.initialize_megatron", _allow_host_only, "wrap", FEATURE),
            Patch(
                "megatron.training.initialize._warmup_jit_function",
                _warm_up_without_moving_host_rng,
                "wrap",
                FEATURE,
            ),
            Patch(
                "megatron.training.datasets.data_samplers.build_pretraining_data_loader",
                _host_generator_for_data_loader,
                "wrap",
                FEATURE,
            ),
        ]
    return result
