"""The one line: ``import hyper_adaptor.megatron_adaptor`` (after ``import torch``).

On import it applies level 0 at once — so that ``import megatron.core`` / ``megatron.training``
work on the detected accelerator — and hooks megatron.training's argument handling:

* ``add_megatron_arguments`` (looked up by ``parse_args`` at call time, so a seam that works for
  Megatron-LM's own pretrain scripts, which pass their own ``extra_args_provider``) also adds
  ``--optimization-level`` and every feature's flags;
* ``validate_args`` first runs every enabled feature's ``adjust`` (level 0 switches platform-unworkable
  defaults) and ``validate``, then Megatron's own checks, then puts back flags hidden from them and
  applies the selected features' patches (docs/contract.md).

Before any of that, and before megatron is imported, it finds the megatron-core Python would import
(pip package or a Megatron-LM checkout) and refuses a release it is not checked against
(hyper_adaptor/megatron_version.py).

Frameworks that build Megatron's arguments themselves call ``hyper_adaptor.adapt(args)``.
Checkpoint writers that re-import the main script re-run this import, so they get level 0 too.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys

import torch  # noqa: F401  (the adaptor is imported after torch, as in Megatron's scripts)

from hyper_adaptor import features, megatron_version, mindspeed_flags, platform
from hyper_adaptor.features import DEFAULT_LEVEL, FEATURES, FeatureConfigError
from hyper_adaptor.features.base import restore_hidden
from hyper_adaptor.notice import notice
from hyper_adaptor.patch_manager import Patch, PatchManager
from hyper_adaptor.patches import adaptor_hooks

logger = logging.getLogger("hyper_adaptor")
FEATURE = "adaptor"


def _preselected_device() -> str | None:
    """``--device-type`` must be known before megatron is imported, i.e. before argparse runs."""
    argv = sys.argv[1:]
    for i, token in enumerate(argv):
        if token == "--device-type" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--device-type="):
            return token.split("=", 1)[1]
    return None


def _add_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("hyper_adaptor")
    group.add_argument(
        "--optimization-level",
        type=int,
        choices=(0, 1, 2),
        default=DEFAULT_LEVEL,
        help="0: compatibility only; 1: + fused kernels; 2: + parallel and memory algorithms (default 2).",
    )
    for feature in FEATURES:
        feature.add_arguments(parser)
    mindspeed_flags.add_arguments(parser)  # after ours: a flag defined here is ours (the table answers it)
    return parser


def _with_adaptor_flags(original):
    @functools.wraps(original)
    def add_megatron_arguments(parser):
        return _short_usage(_add_flags(original(parser)))

    return add_megatron_arguments


class Adaptor:
    """Process-wide state: one patch manager, level 0 applied once, features applied once."""

    def __init__(self):
        self.manager: PatchManager | None = None
        self.applied_features: set[str] = set()
        self.device_type: str | None = None
        self.megatron: megatron_version.MegatronVersion | None = None
        # the level of the last prepared namespace; code without a command line (a TransformerConfig
        # built by a library user) reads it through patches/adaptor_hooks.py
        self.optimization_level: int | None = None

    def bootstrap(self) -> None:
        if self.manager is not None:
            return
        # Before anything imports megatron: which one Python would import, and whether it is supported.
        self.megatron, warning = megatron_version.check()
        if warning:
            notice(warning)
        self.manager = PatchManager(version_info=lambda: str(self.megatron))
        compat = features.get("compat")
        self.manager.register_all(compat.import_patches())
        self.manager.apply()
        self.device_type = platform.select_device_type(_preselected_device())
        notice(f"adapting {self.megatron} on {self.device_type}")
        if self.device_type == "npu":
            from hyper_adaptor.platform import npu

            # torch_npu's own "cuda" -> "npu" mapping patches torch itself (not through this manager:
            # its maintainers keep it in step with torch_npu); describe lists it.
            npu.enable_transfer_to_npu()
        # the one way a patch asks the adaptor for a decision (the level of a config built without a
        # command line, whether a level-1 feature serves a fusion switch, applying it): handed down here
        adaptor_hooks.connect(adaptor_hooks.AdaptorHooks(
            level=lambda: self.optimization_level,
            feature_enabled=lambda name, args: features.get(name).is_enabled(args),
            apply_feature=self.apply_feature,
            default_level=DEFAULT_LEVEL,
        ))
        self.manager.register_all(compat.patches(None))
        self.manager.register_all(
            [
                Patch("megatron.training.arguments.add_megatron_arguments", _with_adaptor_flags, "wrap", FEATURE),
                Patch("megatron.training.arguments.validate_args", _validating_features, "wrap", FEATURE),
            ]
        )
        self.manager.apply()
        self.applied_features.add(compat.name)

    def prepare(self, args, say: bool = True) -> list[str]:
        """Fill missing flags, then (docs/contract.md) every enabled feature's ``adjust``
        in FEATURES order, then every enabled feature's ``validate``. Returns the notices (each is
        also said once, from rank 0)."""
        if not hasattr(args, "optimization_level"):
            args.optimization_level = DEFAULT_LEVEL
        if args.optimization_level not in (0, 1, 2):
            raise FeatureConfigError(
                f"--optimization-level must be 0, 1 or 2; got {args.optimization_level!r}"
            )
        self.optimization_level = args.optimization_level
        for feature in FEATURES:
            feature.fill_defaults(args)
        if getattr(args, "device_type", "auto") not in ("auto", self.device_type):
            raise FeatureConfigError(
                f"--device-type {args.device_type} differs from the device chosen at import "
                f"({self.device_type}); pass it on the command line or set HYPER_ADAPTOR_DEVICE"
            )
        # MindSpeed's flags become ours before any feature reads them (a refused one ends here); their
        # notices are said, and describe lists them in a section of their own
        mindspeed = mindspeed_flags.apply(args)
        for message in mindspeed if say else ():
            notice(message)
        notices = []
        # compat (first in FEATURES) switches platform-unworkable defaults before any other feature
        # looks at them, so that features adjust and validate the arguments the run will really use
        for feature in FEATURES:
            if feature.is_enabled(args):
                notices += feature.adjust(args)
        for feature in FEATURES:
            if feature.level > args.optimization_level and feature.asked_explicitly(args):
                if feature.refuse_below_level:
                    raise FeatureConfigError(feature.below_level_error(args))
                # Not an error: the same command line at a lower level must run, with Megatron's
                # own behaviour for this feature. Said once, naming flag and level.
                flags = ", ".join(f.name for f in feature.flags)
                notices.append(
                    f"{flags} ({feature.name}) is a level-{feature.level} feature but "
                    f"--optimization-level is {args.optimization_level}: not applied"
                )
        for message in notices if say else ():
            notice(message)
        for feature in FEATURES:
            if feature.is_enabled(args):
                feature.validate(args)
        return notices

    def apply_features(self, args) -> list[str]:
        """Apply every enabled feature's patches (once each); returns the names applied now."""
        newly = []
        for feature in FEATURES:
            if feature.name in self.applied_features or not feature.is_enabled(args):
                continue
            patches = feature.patches(args)
            self.manager.register_all(patches)
            newly.append(feature.name)
            if not feature.always_on:
                notice(f"{feature.name} (level {feature.level}) applied: {len(patches)} patch(es)")
        self.manager.apply()
        for name in newly:
            features.get(name).on_applied(args)
            self.applied_features.add(name)
        return newly

    def apply_feature(self, name: str, level: int) -> None:
        """Apply one feature that a megatron-core object asked for without a command line (a fusion
        switch on a TransformerConfig): its flags at their defaults except the one that requests it."""
        feature = features.get(name)
        if name in self.applied_features:
            return
        if feature.level > level:
            raise FeatureConfigError(feature.below_level_error(argparse.Namespace(optimization_level=level)))
        args = argparse.Namespace(optimization_level=level)
        feature.fill_defaults(args)
        for flag in feature.flags:
            setattr(args, flag.dest, True)
        patches = feature.patches(args)
        self.manager.register_all(patches)
        self.manager.apply()
        feature.on_applied(args)
        self.applied_features.add(name)
        notice(f"{feature.name} (level {feature.level}) applied: {len(patches)} patch(es)")


ADAPTOR = Adaptor()


def _validating_features(original):
    @functools.wraps(original)
    def validate_args(args, defaults={}):  # noqa: B006  (megatron's own signature)
        ADAPTOR.prepare(args)
        result = original(args, defaults)
        restore_hidden(args)
        ADAPTOR.apply_features(args)
        return result

    return validate_args


def adapt(args):
    """For frameworks that build Megatron's argument namespace themselves: validate the features'
    flags on ``args`` and apply the selected patches. Idempotent. Returns ``args``."""
    ADAPTOR.bootstrap()
    ADAPTOR.prepare(args)
    restore_hidden(args)  # no megatron validate_args in between here
    ADAPTOR.apply_features(args)
    return args


# ---------------------------------------------------------------- bad input at the import line and in the flags


def _short_usage(parser):
    from hyper_adaptor import usage

    return usage.on_parser(parser)


def _bootstrap_or_exit() -> None:
    """A bad HYPER_ADAPTOR_* variable or --device-type ends the script here as argparse ends it for
    a bad flag (one paragraph on stderr, exit status 2), before megatron is imported; then bad flags
    and combinations found by the argument checks end it the same way (hyper_adaptor/usage.py)."""
    from hyper_adaptor import environment, usage

    try:
        unread = environment.check()
        # the same choice bootstrap makes, made first so that a bad one stops before megatron is imported
        environment.check_for_device(platform.select_device_type(_preselected_device()))
        ADAPTOR.bootstrap()
    except (environment.EnvironmentConfigError, platform.DeviceChoiceError) as error:
        usage.fail(str(error))
    for message in unread:
        notice(message)
    ADAPTOR.manager.register(usage.patch(FEATURE))
    ADAPTOR.manager.apply()


_bootstrap_or_exit()
