"""Level 0 — megatron's ``--deterministic-mode``, made to hold for the adaptor too (docs/features/determinism.md).

Megatron's own set-up (``megatron/training/determinism.py``, run from its ``validate_args``) checks two
arguments, sets NCCL's / cuBLAS's / Transformer Engine's variables straight into ``os.environ`` and turns
on ``torch.use_deterministic_algorithms``. It knows nothing of the device the adaptor runs on (HCCL on
NPU), of the adaptor's fused kernels, or of its engines; and what it writes into the environment is
outside the patch manager, so ``describe`` cannot show it and undo cannot take it back.

So this feature serves the flag itself:

- ``adjust`` hides ``--deterministic-mode`` from megatron's ``validate_args`` (put back right after, so
  the model config still gets ``deterministic_mode=True``: megatron's embedding then avoids its
  nondeterministic backward) — megatron's set-up does not run, this feature's does instead;
- ``validate`` makes megatron's checks (``--cross-entropy-loss-fusion``, ``--tp-comm-overlap``) and the
  device's variables a launcher set (``NCCL_ALGO=Tree``, ``HCCL_DETERMINISTIC=false``, ...) errors that
  name the flag or variable, before anything is built;
- ``patches`` sets the device's variables (``item`` patches) and the fused ops' deterministic choice;
- ``on_applied`` turns on torch's switch (and cuDNN's on CUDA), still before the model is built.

Level 0: determinism is a property of the run, asked at any ``--optimization-level``.
"""

from __future__ import annotations

from hyper_adaptor import platform
from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag, asked, hide_from_megatron, refuse_combined
from hyper_adaptor.notice import notice

DEST = "deterministic_mode"

# megatron's ARG_VALUES_REQUIRED_FOR_DETERMINISM, as flags: each is refused, never switched off silently
REFUSED_FLAGS = {
    "cross_entropy_loss_fusion": "--cross-entropy-loss-fusion (its fused kernel's backward is not deterministic; "
                                 "megatron refuses it too)",
    "tp_comm_overlap": "--tp-comm-overlap (Transformer Engine's userbuffers overlap splits GEMMs and reductions "
                       "by timing; megatron refuses it too)",
}


class Determinism(Feature):
    name = "determinism"
    level = 0
    summary = ("--deterministic-mode for the whole flow: torch's and the device's switches, deterministic fused "
               "kernels, engines with a fixed reduction order")
    flags = (
        Flag("--deterministic-mode", "megatron's flag; served by hyper_adaptor on every device", owner="megatron"),
    )

    def requested(self, args) -> bool:
        # read through ``asked``: between adjust and megatron's check the flag is hidden from megatron
        return bool(asked(args, DEST))

    def adjust(self, args) -> list[str]:
        # megatron's validate_args would run its own set-up (environment written outside the patch
        # manager, CUDA-only variables); this feature runs the device's one instead (patches, on_applied)
        return [hide_from_megatron(args, DEST, f"megatron's own set-up writes CUDA variables outside the patch "
                                               f"manager; hyper_adaptor sets up {platform.device_type()} instead")]

    def validate(self, args) -> None:
        from hyper_adaptor.patches import determinism

        refuse_combined(args, "--deterministic-mode", REFUSED_FLAGS)
        device = platform.device_type()
        problems = determinism.env_problems(device)
        if problems:
            raise FeatureConfigError(f"--deterministic-mode on {device}: the environment asks for nondeterministic "
                                     f"settings: {'; '.join(problems)}")

    def patches(self, args):
        from hyper_adaptor.patches import determinism

        return determinism.patches(platform.device_type())

    def on_applied(self, args) -> None:
        from hyper_adaptor.patches import determinism

        device = platform.device_type()
        switched = determinism.switch_on(device)
        env = ", ".join(f"{k}={v}" for k, v in determinism.switches_state(device)["env"].items())
        notice(f"--deterministic-mode on {device}: {'; '.join(switched)}; fused ops pick deterministic kernels"
               + (f"; {env}" if env else ""))
