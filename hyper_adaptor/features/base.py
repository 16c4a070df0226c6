"""The Feature contract (docs/contract.md): what a feature declares to the adaptor.

For every command line the adaptor runs, in this fixed order (features in ``FEATURES`` order):

1. ``adjust(args)`` of each enabled feature — the only place Megatron's arguments are changed: a
   default that cannot work is switched (:func:`switch`), a flag megatron would reject is hidden from
   its checks (:func:`hide_from_megatron`), a flag hyper_adaptor serves instead of megatron is taken
   from it for the run (:func:`take_from_megatron`); returns one notice per change. What was hidden or
   taken is kept in one record on the namespace (:data:`RECORD`), read back with :func:`asked`;
2. ``validate(args)`` of each enabled feature — checks only: raises FeatureConfigError naming the
   flags, never changes ``args``;
3. megatron's own ``validate_args``; then hidden flags are put back (:func:`restore_hidden`);
4. ``patches(args)`` of each enabled feature, registered and applied through one PatchManager;
   ``patches`` is pure: it keeps nothing on the feature or in a module, everything the replacements
   need is bound into them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from hyper_adaptor.patch_manager import Patch
from hyper_adaptor.patches.compat.arguments import switch

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
    # True for a feature without which megatron cannot run the requested configuration at all (e.g.
    # context parallel on the local spec): requested below its level it is an error
    # (``below_level_error``), not the usual "not applied" notice
    refuse_below_level: bool = False

    def requested(self, args) -> bool:
        """True when the user asked for this feature on the command line."""
        if self.always_on:
            return True
        return any(getattr(args, f.dest, f.default()) not in (None, False) for f in self.flags)

    def is_enabled(self, args) -> bool:
        return self.requested(args) and self.level <= args.optimization_level

    def below_level_error(self, args) -> str:
        flags = ", ".join(f.name for f in self.flags)
        return f"{flags} ({self.name}) needs --optimization-level >= {self.level}; got {args.optimization_level}"

    def adjust(self, args) -> list[str]:
        """Change ``args`` where this feature needs megatron to see something else; one notice per change."""
        return []

    def validate(self, args) -> None:
        """Raise FeatureConfigError naming the flags when this feature's flags do not fit together.
        Checks only: ``args`` is left as it is (the adaptor's tests hold every feature to that)."""

    def patches(self, args) -> list[Patch]:
        return []

    def on_applied(self, args) -> None:
        """Run once after this feature's patches are applied (process state such as a backend choice;
        never a change of ``args``)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        if not self.flags:
            return
        if all(f.owner == "megatron" for f in self.flags):
            return
        group = parser.add_argument_group(f"hyper_adaptor: {self.name} (level {self.level})")
        for flag in self.flags:
            flag.add_to(group)

    def asked_explicitly(self, args) -> bool:
        """Requested, by a flag set away from its default (Megatron-owned flags may default to on: a
        feature served whenever megatron's default is on overrides this to say it was not asked)."""
        if not self.requested(args):
            return False
        return any(_set(asked(args, f.dest, f.default()), f.default()) for f in self.flags)

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


def _set(value, default) -> bool:
    return value is not None and value is not False and value != default


def refuse_combined(args, asked_for: str, conflicts: dict) -> None:
    """Raise FeatureConfigError ``"<asked_for> cannot be combined with <what>"`` for the first flag of
    ``conflicts`` (argument dest -> how to name it, why included) that is set in ``args``."""
    for dest, what in conflicts.items():
        if getattr(args, dest, None):
            raise FeatureConfigError(f"{asked_for} cannot be combined with {what}")


# The one record of what ``adjust`` took from megatron, kept on the namespace it was taken from (a
# plain dict, so that megatron can print, copy and checkpoint the namespace as it does every other
# argument): {"hidden": {dest: value}, "taken": {dest: value}}, each value the one the user gave.
RECORD = "hyper_adaptor_taken"


def _record(args) -> dict:
    record = getattr(args, RECORD, None)
    if record is None:
        record = {"hidden": {}, "taken": {}}
        setattr(args, RECORD, record)
    return record


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def hide_from_megatron(args, dest: str, why: str) -> str:
    """Lower a flag while megatron validates the arguments (it would reject a value that hyper_adaptor
    serves); :func:`restore_hidden` puts it back right after, before anything is built from ``args``.
    Returns the notice, naming the flag."""
    _record(args)["hidden"].setdefault(dest, getattr(args, dest))
    setattr(args, dest, False)
    return f"{_flag(dest)}: hidden from megatron's argument checks and put back right after them ({why})"


def take_from_megatron(args, dest: str, value, why: str) -> str:
    """Switch a megatron flag for the whole run because hyper_adaptor serves it instead (megatron's own
    code for it must not run); the value asked stays readable through :func:`asked`. Returns the notice."""
    _record(args)["taken"].setdefault(dest, getattr(args, dest, None))
    return switch(args, dest, value, why)


def restore_hidden(args) -> None:
    """Put back the flags hidden from megatron's checks (taken flags stay switched for the run)."""
    record = getattr(args, RECORD, None)
    if record is None:
        return
    for dest, value in record["hidden"].items():
        setattr(args, dest, value)
    record["hidden"].clear()
    if not record["taken"]:
        delattr(args, RECORD)


def taken(args) -> dict:
    """{dest: value asked} of every flag adjust hid from or took from megatron (what the record holds)."""
    record = getattr(args, RECORD, None) or {"hidden": {}, "taken": {}}
    return {**record["taken"], **record["hidden"]}


def asked(args, dest: str, default=None):
    """A flag's value as the user gave it, hidden from or taken from megatron or not."""
    record = getattr(args, RECORD, None)
    if record is not None:
        for part in ("hidden", "taken"):
            if dest in record[part]:
                return record[part][dest]
    return getattr(args, dest, default)
