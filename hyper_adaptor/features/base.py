"""The Feature contract (DESIGN §4): what a feature declares to the adaptor."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Callable

from hyper_adaptor.patch_manager import Patch

LEVEL_NAMES = {0: "compatibility", 1: "affinity (fused kernels)", 2: "algorithms"}
DEFAULT_LEVEL = 2


class FeatureConfigError(ValueError):
    """Bad or conflicting feature flags; the message names the flags."""


@dataclass
class Flag:
    """One command-line flag in Megatron's conventions (``--kebab-case``; switches are store_true)."""

    name: str
    help: str
    kwargs: dict = field(default_factory=dict)
    # "megatron": the flag is Megatron's own (e.g. --use-flash-attn, --gradient-accumulation-fusion);
    # the feature reads it but does not add it to the parser (``default()`` is only what a namespace
    # built without Megatron's parser gets, see ``fill_defaults``).
    owner: str = "hyper_adaptor"

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def add_to(self, group) -> None:
        if self.owner == "megatron":
            return
        kwargs = dict(self.kwargs) or {"action": "store_true"}
        group.add_argument(self.name, help=self.help, **kwargs)

    def default(self):
        kwargs = self.kwargs or {"action": "store_true"}
        if kwargs.get("action") == "store_true":
            return False
        return kwargs.get("default")


class Feature:
    """Subclass per feature. ``always_on`` features (level 0) apply whenever their level does."""

    name: str = ""
    level: int = DEFAULT_LEVEL
    summary: str = ""
    flags: tuple[Flag, ...] = ()
    always_on: bool = False

    def requested(self, args) -> bool:
        """True when the user asked for this feature on the command line."""
        if self.always_on:
            return True
        return any(getattr(args, f.dest, f.default()) not in (None, False) for f in self.flags)

    def is_enabled(self, args) -> bool:
        return self.requested(args) and self.level <= args.optimization_level

    def validate(self, args) -> None:
        """Raise FeatureConfigError naming the flags when this feature's flags do not fit together."""

    def patches(self, args) -> list[Patch]:
        return []

    def on_applied(self, args) -> None:
        """Hook run once after this feature's patches are applied."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        if not self.flags:
            return
        if all(f.owner == "megatron" for f in self.flags):
            return
        group = parser.add_argument_group(f"hyper_adaptor: {self.name} (level {self.level})")
        for flag in self.flags:
            flag.add_to(group)

    def asked_explicitly(self, args) -> bool:
        """Requested by a flag set away from its default (Megatron-owned flags may default to on)."""
        return any(getattr(args, f.dest, f.default()) not in (None, False, f.default()) for f in self.flags)

    def fill_defaults(self, args) -> None:
        """Give namespaces built without our parser (``hyper_adaptor.adapt(args)``) the flag defaults."""
        for flag in self.flags:
            if not hasattr(args, flag.dest):
                setattr(args, flag.dest, flag.default())

    def status(self, args) -> tuple[bool, str]:
        """(applies, why) for ``describe``."""
        if self.always_on and self.level <= args.optimization_level:
            return True, f"level {self.level} is always on"
        if not self.requested(args):
            names = ", ".join(f.name for f in self.flags) or "(no flag)"
            return False, f"not requested ({names})"
        if self.level > args.optimization_level:
            return False, f"needs --optimization-level >= {self.level}"
        return True, "requested"


Validator = Callable[[argparse.Namespace], None]
