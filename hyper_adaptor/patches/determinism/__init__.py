"""--deterministic-mode: the process-wide switches, per device (docs/features/determinism.md).

- environment variables the communication and math libraries read when they start (NCCL at
  communicator creation, cuBLAS at handle creation, HCCL at communicator creation): ``item`` patches on
  ``os.environ``, registered only for variables the launcher left unset (a value it set is checked by
  :func:`env_problems` and kept), so that ``describe`` lists them and undo removes them again;
- ``hyper_adaptor.ops.backend.DETERMINISTIC``: the fused ops skip kernels that are not deterministic
  (a ``replace`` patch);
- torch's own switch (``torch.use_deterministic_algorithms``, and cuDNN's flags on CUDA) is process
  state, not an attribute or a mapping entry: :func:`switch_on`, run by the feature's ``on_applied``
  — still inside megatron's ``validate_args``, before the model, the optimizer or any communicator
  is built.

Only this module names device libraries' settings; the feature decides when they apply.
"""

from __future__ import annotations

import os

import torch

from hyper_adaptor.patch_manager import Patch

FEATURE = "determinism"

# What each device's libraries need for bitwise-repeatable runs, set where the launcher did not set them.
ENV: dict[str, dict[str, str]] = {
    # NCCL: the ring algorithm reduces every element in a fixed rank order (megatron's choice too; its
    # Tree and NVLS algorithms do not fix the order). cuBLAS: one of the two workspace configurations
    # NVIDIA documents as deterministic; torch refuses cuBLAS GEMMs under its deterministic switch
    # without it. Transformer Engine (if a user runs megatron's TE spec): no nondeterministic kernels.
    "cuda": {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"},
    # HCCL: deterministic AllReduce / ReduceScatter / Reduce (CANN's HCCL_DETERMINISTIC, default false)
    "npu": {"HCCL_DETERMINISTIC": "true"},
    # gloo's collectives and torch's CPU kernels need no switch (docs: why)
    "cpu": {},
}

# Values a launcher may have set that keep the run deterministic; anything else is refused by name.
NCCL_ALGO_TOKENS = ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")  # megatron's accepted set
ACCEPTED: dict[str, tuple[str, ...]] = {
    "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",),
    "HCCL_DETERMINISTIC": ("true", "strict"),  # CANN: false (default), true, strict (also fixes the order)
}


def env_problems(device: str, env=None) -> list[str]:
    """Launcher-set variables of ``device``'s libraries that would make the run nondeterministic."""
    env = os.environ if env is None else env
    problems = []
    for name in ENV.get(device, {}):
        value = env.get(name)
        if value is None:
            continue
        if name == "NCCL_ALGO":
            tokens = [t.strip() for t in value.split(",") if t.strip()]
            if not tokens or any(t not in NCCL_ALGO_TOKENS for t in tokens):
                problems.append(f"NCCL_ALGO={value!r} (each algorithm must be one of {', '.join(NCCL_ALGO_TOKENS)}; "
                                f"Tree and NVLS do not fix the reduction order)")
        elif value.lower() not in ACCEPTED[name]:
            problems.append(f"{name}={value!r} (accepted: {', '.join(ACCEPTED[name])})")
    mamba = env.get("MAMBA_DETERMINISTIC")
    if device == "cuda" and mamba and not mamba.startswith("1"):
        problems.append(f"MAMBA_DETERMINISTIC={mamba!r} (unset it or set 1)")
    return problems


def env_patches(device: str, env=None) -> list[Patch]:
    env = os.environ if env is None else env
    return [Patch(f"os.environ.{name}", value, "item", FEATURE)
            for name, value in ENV.get(device, {}).items() if name not in env]


def patches(device: str) -> list[Patch]:
    return env_patches(device) + [Patch("hyper_adaptor.ops.backend.DETERMINISTIC", True, "replace", FEATURE)]


def switch_on(device: str) -> list[str]:
    """torch's deterministic switches for this process; returns what was switched (for the notice).

    ``warn_only`` stays False: on CUDA that is what makes the flash and memory-efficient attention
    backwards take their deterministic paths and keeps cuDNN's attention out of SDPA's choice, and
    an op with no deterministic kernel raises instead of warning. It also turns on Inductor's
    deterministic mode (no benchmarking that changes numerics) for the ops compiled later."""
    torch.use_deterministic_algorithms(True)
    switched = ["torch.use_deterministic_algorithms(True)"]
    if device == "cuda":
        # convolutions only, which megatron's GPT does not run; set anyway for models that do
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        switched.append("cudnn.deterministic=True, cudnn.benchmark=False")
    return switched


def switches_state(device: str) -> dict:
    """What a rank sees (tests read it inside each rank)."""
    from hyper_adaptor.ops import backend

    state = {"torch_deterministic": torch.are_deterministic_algorithms_enabled(),
             "torch_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
             "ops_deterministic": backend.DETERMINISTIC,
             "env": {name: os.environ.get(name) for name in ENV.get(device, {})}}
    if device == "cuda":
        state["cudnn"] = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    return state
