"""``python -m hyper_adaptor describe [megatron flags]``: what would apply, and what it patches.

``describe`` parses the flags with megatron.training's own parser (so Megatron's flags are accepted
as they are), runs the features' validation, and prints every feature with its level, whether it
applies and why, and every target it patches — without training anything.
"""

from __future__ import annotations

import argparse
import sys


def _parse_megatron_flags(flags: list[str]):
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(prog="hyper_adaptor describe", allow_abbrev=False)
    add_megatron_arguments(parser)  # wrapped by the adaptor: adds --optimization-level and feature flags
    args, unknown = parser.parse_known_args(flags)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def describe(flags: list[str], out=sys.stdout) -> int:
    """Print what would apply; returns 1 when a patch target does not resolve in this megatron-core."""
    from hyper_adaptor import megatron_adaptor
    from hyper_adaptor.features import FEATURES, LEVEL_NAMES

    adaptor = megatron_adaptor.ADAPTOR
    args = _parse_megatron_flags(flags)
    adjustments = adaptor.prepare(args, say=False)
    level = args.optimization_level
    print(f"hyper_adaptor on {adaptor.device_type} (backend {args.distributed_backend}), {adaptor.megatron}",
          file=out)
    print(f"--optimization-level {level} ({LEVEL_NAMES[level]})", file=out)
    if adjustments:
        print("\nadjustments to megatron's arguments:", file=out)
        for message in adjustments:
            print(f"    {message}", file=out)
    missing = 0
    registered = adaptor.manager.patches

    def show(patches):
        nonlocal missing
        for patch in patches:
            problem = adaptor.manager.check(patch)
            missing += problem is not None
            mark = f"  MISSING: {problem}" if problem else ""
            print(f"    {patch.kind:7s} {patch.target}{mark}", file=out)

    for feature in FEATURES:
        applies, why = feature.status(args)
        print(f"\n[{'x' if applies else ' '}] {feature.name}  (level {feature.level}) — {why}", file=out)
        print(f"    {feature.summary}", file=out)
        if not applies:
            continue
        if feature.always_on:  # applied at import: what is registered is what runs
            show([p for p in registered if p.feature == feature.name])
        else:
            show(feature.patches(args))
    print("\n[x] adaptor hooks (always)", file=out)
    show([p for p in registered if p.feature == megatron_adaptor.FEATURE])
    if adaptor.device_type == "npu":
        print("    (torch_npu.contrib.transfer_to_npu: torch_npu's own cuda -> npu mapping, applied at import)",
              file=out)
    if missing:
        print(f"\n{missing} patch target(s) MISSING in {adaptor.megatron}", file=out)
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m hyper_adaptor describe [megatron and hyper_adaptor flags]")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "describe":
        # the device choice is made at import, from --device-type if present
        sys.argv = [sys.argv[0]] + rest
        from hyper_adaptor.features import FeatureConfigError

        try:
            return describe(rest)
        except FeatureConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    print(f"unknown command {command!r}; known: describe", file=sys.stderr)
    return 2
