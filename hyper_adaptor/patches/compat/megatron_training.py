"""Level-0 patches on megatron.training: start-up on a process without CUDA, and host-side RNG.

Argument defaults that cannot work on the platform are switched in ``arguments.py`` (of this
package), before megatron validates them; the patches here are the run-time seams.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
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


def _python3_for_make() -> str | None:
    """The ``python3`` megatron's make runs: this interpreter's own when its directory has one (put first
    on PATH for the build, see :func:`_build_for_this_interpreter`), else the one on PATH."""
    own = Path(sys.executable).parent / "python3"
    return str(own) if own.exists() else shutil.which("python3")


def _build_for_this_interpreter(original):
    """Rank 0 runs ``make`` to build the dataset helpers. The megatron-core wheel ships them prebuilt and
    no Makefile (building fails on every platform): build only when they are missing. A checkout's
    Makefile names the library by the ``python3-config`` on PATH and takes the pybind11 headers from the
    ``python3`` on PATH; in a virtual environment (no python3-config of its own) or a checkout whose
    ``.python-version`` picks another pyenv Python, those are another interpreter's, and the library
    built is one this Python cannot import. So make runs with this interpreter's directory first on PATH
    and its extension suffix given as ``LIBEXT`` (a command-line variable through MAKEFLAGS, which
    overrides the Makefile's own)."""

    @functools.wraps(original)
    def compile_helpers(*args, **kwargs):
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
            logger.info("megatron dataset helpers are prebuilt in the wheel; not running make")
            return None
        saved = {name: os.environ.get(name) for name in ("PATH", "MAKEFLAGS")}
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), saved["PATH"] or ""])
        if suffix:
            os.environ["MAKEFLAGS"] = " ".join(filter(None, [saved["MAKEFLAGS"], f"LIBEXT={suffix}"]))
        try:
            return original(*args, **kwargs)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

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
    if datasets_dir is None:
        return None
    ours = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    if (datasets_dir / f"helpers_cpp{ours}").exists():
        return None
    others = sorted(p.name for p in datasets_dir.glob("helpers_cpp*") if p.suffix in (".so", ".pyd"))
    if others and ours == ".so":  # an interpreter without a tagged suffix imports any of them
        return None
    if others:
        return (f"megatron's dataset helpers in {datasets_dir} are built for another Python ({', '.join(others)}; "
                f"this one imports helpers_cpp{ours}): megatron's make used a python3-config that is not this "
                f"interpreter's (e.g. a .python-version file in the checkout picking another pyenv Python). Fix: "
                f"remove them; megatron's start-up then builds them for this interpreter")
    where = f"megatron's dataset helpers ({datasets_dir}/helpers.cpp) are not built"
    if not (datasets_dir / "Makefile").is_file():
        return f"{where} and there is no Makefile to build them with; reinstall megatron-core or use a full checkout"
    python3 = python3 or _python3_for_make()
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
        Patch("megatron.core.datasets.utils.compile_helpers", _build_for_this_interpreter, "wrap", FEATURE),
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
