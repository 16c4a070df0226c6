"""Level 0 — megatron's checkpoints, made to move between layouts and to survive failures
(docs/features/checkpoints.md).

Requested whenever the run saves or loads (megatron's ``--save`` / ``--load``):

- ``validate`` reads the checkpoint a ``--load`` points at and refuses, before anything is built, a layout
  transition that cannot work, naming both layouts (``patches/checkpoint/layout.py``);
- ``patches`` let optimizer state move between megatron's distributed optimizer and the per-parameter
  optimizers HSDP runs on (``patches/checkpoint/optimizer_formats.py``), record beside every saved
  checkpoint the layout and features that shaped it (``layout.py``), and keep the checkpoint resumed from a
  complete one (``patches/checkpoint/survival.py``); a synchronous save starts no process per rank
  (``patches/checkpoint/sync_save.py``).
"""

from __future__ import annotations

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag


class Checkpoint(Feature):
    name = "checkpoint"
    level = 0
    summary = ("checkpoints that move between layouts (checked before loading) and survive failures: the layout "
               "recorded beside each save, only complete checkpoints resumed from")
    flags = (
        Flag("--save", "megatron's flag; the checkpoint records its layout", owner="megatron"),
        Flag("--load", "megatron's flag; checked against this run's layout before loading", owner="megatron"),
    )

    def requested(self, args) -> bool:
        return bool(getattr(args, "save", None) or getattr(args, "load", None))

    def validate(self, args) -> None:
        from hyper_adaptor.patches.checkpoint import layout, survival

        torn = survival.problems(args)
        if torn:
            raise FeatureConfigError(torn[0])
        problems = layout.problems(args)
        if problems:
            raise FeatureConfigError("--load: " + "; and ".join(problems))

    def patches(self, args):
        from hyper_adaptor.patches.checkpoint import layout, optimizer_formats, survival, sync_save

        return [*layout.patches(args, applied_features(args)), *optimizer_formats.patches(args),
                *survival.patches(args), *sync_save.patches(args)]


def applied_features(args) -> tuple[str, ...]:
    """The hyper_adaptor features a run with these arguments applies, the always-on ones aside: what
    a checkpoint records as having shaped it (also read back from an older checkpoint's saved args)."""
    import argparse

    from hyper_adaptor.features import FEATURES

    if getattr(args, "optimization_level", None) is None:
        return ()  # not a hyper_adaptor run
    probe = argparse.Namespace(**vars(args))
    names = []
    for feature in FEATURES:
        if feature.always_on or feature.name == Checkpoint.name:
            continue
        feature.fill_defaults(probe)
        if feature.is_enabled(probe):
            names.append(feature.name)
    return tuple(names)
