"""The environment variables hyper_adaptor reads, checked together at the import line as flags are.

A variable is read where it is used (the device at bootstrap, the fused-op backend at the first fused
call, the optimization level when a ``TransformerConfig`` is built without a command line), which can
be long after start-up or never. A value that would be refused there, or silently ignored, is refused
here instead, before megatron is imported, with a message naming the variable.

Imported only by the entry points (``hyper_adaptor.megatron_adaptor``, ``hyper_adaptor.cli``): it
gathers the names and allowed values from the layers that own them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hyper_adaptor import megatron_version, platform
from hyper_adaptor.ops import backend
from hyper_adaptor.patches.compat import fusion_switches

PREFIX = "HYPER_ADAPTOR_"


class EnvironmentConfigError(ValueError):
    """An environment variable hyper_adaptor (or megatron's argument parser) reads has a bad value."""


def _one_of(*choices: str) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        if value in choices:
            return None
        hint = "; they are lower case" if value.lower() in choices else ""
        return f"must be one of {', '.join(choices)}{hint}"

    return check


def _integer(minimum: int) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        try:
            number = int(value)
        except ValueError:
            return "must be an integer"
        return None if number >= minimum else f"must be >= {minimum}"

    return check


@dataclass(frozen=True)
class Variable:
    name: str
    check: Callable[[str], str | None]  # None when the value is good, else what it must be
    meaning: str


CACHE_ENV = "HYPER_ADAPTOR_CACHE"  # read by the dry-run's calibration (hyper_adaptor/dryrun/calibrate.py)

VARIABLES = (
    Variable(platform.DEVICE_ENV, _one_of("auto", *platform.DEVICE_TYPES),
             "the device, as --device-type (a launcher's children inherit the parent's choice)"),
    Variable(backend.BACKEND_ENV, _one_of("auto", *backend.BACKENDS),
             "the first backend of every fused op, as --fused-backend"),
    Variable(fusion_switches.LEVEL_ENV, _one_of("0", "1", "2"),
             "the optimization level of a TransformerConfig built without a command line"),
    Variable(megatron_version.ALLOW_ENV, lambda value: None if value.strip() else "must not be empty",
             "a megatron-core release to run although it is not supported (its version, or 'any')"),
    Variable(CACHE_ENV, lambda value: None if value.strip() else "must not be empty",
             "the directory of the dry-run's cached machine calibration (default ~/.cache/hyper_adaptor)"),
)
# megatron.training's parse_args reads these as integers (torchrun sets them); describe reads WORLD_SIZE.
LAUNCHER_VARIABLES = (
    Variable("WORLD_SIZE", _integer(1), "the number of processes"),
    Variable("RANK", _integer(0), "this process's global rank"),
)


def check(environ: Mapping[str, str] | None = None) -> list[str]:
    """Raise EnvironmentConfigError for the first variable with a bad value; return notices for
    ``HYPER_ADAPTOR_*`` names that nothing reads (a misspelt variable is otherwise silently ignored)."""
    environ = os.environ if environ is None else environ
    for variable in VARIABLES + LAUNCHER_VARIABLES:
        value = environ.get(variable.name)
        if value is None:
            continue
        problem = variable.check(value)
        if problem:
            raise EnvironmentConfigError(f"{variable.name}={value!r}: {problem} ({variable.meaning})")
    world, rank = environ.get("WORLD_SIZE"), environ.get("RANK")
    if world is not None and rank is not None and int(rank) >= int(world):
        raise EnvironmentConfigError(f"RANK={rank} is outside WORLD_SIZE={world} (ranks 0..{int(world) - 1})")
    known = {variable.name for variable in VARIABLES}
    return [f"{name} is not a variable hyper_adaptor reads (known: {', '.join(sorted(known))}); ignored"
            for name in sorted(environ) if name.startswith(PREFIX) and name not in known]


def check_for_device(device_type: str, environ: Mapping[str, str] | None = None) -> None:
    """What can only be judged once the device is chosen: a fused-op backend forced to one this
    device does not have would fall back on every call."""
    environ = os.environ if environ is None else environ
    if environ.get(backend.BACKEND_ENV) == "npu" and device_type != "npu":
        raise EnvironmentConfigError(
            f"{backend.BACKEND_ENV}=npu: this process runs on {device_type}, which has no torch_npu kernels "
            f"(every fused op would fall back); use auto, fast or eager")
