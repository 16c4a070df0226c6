"""``python -m hyper_adaptor describe [megatron flags]``: what would apply, and what it patches.

``describe`` parses the flags with megatron.training's own parser (so Megatron's flags are accepted
as they are), runs the features' validation and megatron's own ``validate_args``, and prints every
feature with its level, whether it applies and why, and every target it patches — without training
anything, and without a process group. Bad input ends as a training run would end on it: one
paragraph naming the flag, exit status 2 (hyper_adaptor/usage.py).

Some checks depend on the number of processes (divisibility by the model-parallel sizes, the
data-parallel size, ``--profile-ranks``, ``--hsdp-shard-size``): ``--world-size N`` or ``WORLD_SIZE``
gives it; without either, describe assumes the smallest world the model-parallel sizes allow and
says so.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import sys
import warnings

PROG = "hyper_adaptor describe"
# megatron's validate_args refuses a namespace without these (so does a training run); describe
# without them still lists the features, and says megatron's checks were not made
MODEL_FLAGS = ("micro_batch_size", "num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")
WORLD_CHECKS = ("the world divisible by TP x PP x CP", "--global-batch-size by --micro-batch-size x the "
                "data-parallel size", "--profile-ranks", "--hsdp-shard-size", "the pipeline's micro-batch count")
_ABOUT_WORLD = ("world", "data-parallel", "data parallel", "--profile-ranks", "--hsdp-shard-size", "global batch",
                "global_batch")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def _world_size(args) -> tuple[int | None, str]:
    """(world size or None, where it came from)."""
    if args.world_size is not None:
        return args.world_size, "--world-size"
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"]), "WORLD_SIZE"  # checked at import (hyper_adaptor/environment.py)
    return None, ""


def megatron_parser(prog: str = PROG, add_arguments=None) -> argparse.ArgumentParser:
    """megatron.training's parser with the adaptor's flags, ``--world-size`` and what ``add_arguments``
    (called with the parser's group) adds for a command. Building it reads megatron's dataclass docstrings
    (about 0.3 s): a caller parsing many command lines (the planner) builds it once and passes it to
    :func:`_parse_megatron_flags`."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    add_megatron_arguments(parser)  # wrapped by the adaptor: adds --optimization-level and feature flags
    group = parser.add_argument_group(prog.split()[-1])
    group.add_argument(
        "--world-size", type=_positive, default=None, metavar="N",
        help="the number of processes the checks assume (default: WORLD_SIZE, else the smallest world "
             "the model-parallel sizes allow)")
    if add_arguments is not None:
        add_arguments(group)
    return parser


def _parse_megatron_flags(flags: list[str], prog: str = PROG, add_arguments=None, parser=None):
    """``flags`` through :func:`megatron_parser` (or ``parser``, one it built); unknown flags are an argparse
    error. A reused parser hands every namespace the same default objects: they are copied, so that a check
    that changes a default list in place changes it for this namespace only."""
    reused = parser is not None
    parser = parser or megatron_parser(prog, add_arguments)
    args, unknown = parser.parse_known_args(flags)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if reused:  # the default containers copied (they hold strings and numbers: one level is the whole of them)
        args = argparse.Namespace(**{k: copy.copy(v) if isinstance(v, (list, dict, set)) else v
                                     for k, v in vars(args).items()})
    return args


def _validate(adaptor, args, world: int | None, source: str) -> tuple[list[str], list[str]]:
    """The checks of a training run, in its order, on ``args``: the number ranges, the features'
    adjust and validate, then megatron's validate_args (its own, not the adaptor's wrap: describe
    applies no feature). Returns (adjustments, the model flags missing for megatron's checks)."""
    from hyper_adaptor import usage

    args.world_size = None
    usage.check_ranges(args)  # the sizes must be numbers >= 1 before a world is assumed from them
    args.rank = 0
    args.world_size = world or usage.model_parallel_size(args)
    args._is_global_batch_size_explicitly_specified = args.global_batch_size is not None
    usage.check_ranges(args, source or "assumed")
    adjustments = adaptor.prepare(args, say=False)
    missing = [dest for dest in MODEL_FLAGS if getattr(args, dest, None) is None
               and not (dest == "num_layers" and getattr(args, "encoder_num_layers", None) is not None)]
    if not missing:
        with contextlib.redirect_stdout(io.StringIO()):  # megatron prints every argument when done
            adaptor.manager.original(usage.VALIDATE_ARGS)(args, {})
    return adjustments, missing


def check(args, prog: str = PROG):
    """The checks of a training run on parsed ``args`` (:func:`_validate`), bad input ended as argparse ends
    it (usage.fail, exit 2). Returns (world size given or None, where it came from, adjustments, the model
    flags missing for megatron's checks)."""
    from hyper_adaptor import megatron_adaptor, usage

    world = None
    try:
        world, source = _world_size(args)
        adjustments, missing = _validate(megatron_adaptor.ADAPTOR, args, world, source)
    except Exception as error:
        message = usage.explain(error)
        if message is None:
            raise
        if world is None and args.world_size and any(word in message for word in _ABOUT_WORLD):
            message += (f" [{prog} assumed a world size of {args.world_size}, the smallest the model-parallel "
                        f"sizes allow: pass --world-size N, or set WORLD_SIZE, for your run]")
        usage.fail(message, prog)
    return world, source, adjustments, missing


def describe(flags: list[str], out=None) -> int:
    """Print what would apply; returns 1 when a patch target does not resolve in this megatron-core.
    Bad input: the message on stderr and SystemExit(2), as argparse."""
    from hyper_adaptor import megatron_adaptor, mindspeed_flags, usage
    from hyper_adaptor.features import FEATURES, LEVEL_NAMES

    out = out or sys.stdout
    adaptor = megatron_adaptor.ADAPTOR
    args = _parse_megatron_flags(flags)
    mindspeed = mindspeed_flags.given(args)  # before the checks turn them into ours
    world, source, adjustments, missing = check(args, PROG)
    level = args.optimization_level
    print(f"hyper_adaptor on {adaptor.device_type} (backend {args.distributed_backend}), {adaptor.megatron}",
          file=out)
    print(f"--optimization-level {level} ({LEVEL_NAMES[level]})", file=out)
    if world is None:
        print(f"world size {args.world_size} assumed (TP x PP x CP, one data-parallel rank: no --world-size or "
              f"WORLD_SIZE); the checks that depend on it ({', '.join(WORLD_CHECKS)}) were made for that size "
              f"only", file=out)
    else:
        print(f"world size {world} ({source}), data-parallel size {world // usage.model_parallel_size(args)}",
              file=out)
    if missing:
        print(f"megatron's own argument checks (validate_args): not made, they need "
              f"{', '.join(usage.flag(dest) for dest in missing)} (so does a training run)", file=out)
    else:
        print("megatron's own argument checks (validate_args): passed", file=out)
    mindspeed_flags.describe(mindspeed, out)
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
            if patch.feature == usage.FEATURE:
                mark += "  (outermost: bad input ends in one error naming the flag)"
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
    show([p for p in registered if p.feature in (megatron_adaptor.FEATURE, usage.FEATURE)])
    if adaptor.device_type == "npu":
        print("    (torch_npu.contrib.transfer_to_npu: torch_npu's own cuda -> npu mapping, applied at import)",
              file=out)
    from hyper_adaptor.patches import megatron_releases

    print("\n" + "\n".join(megatron_releases.report(adaptor.megatron)), file=out)
    if missing:
        print(f"\n{missing} patch target(s) MISSING in {adaptor.megatron}", file=out)
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m hyper_adaptor describe [megatron and hyper_adaptor flags]\n"
              "       python -m hyper_adaptor dry-run [megatron flags] --world-size N [--device-memory GiB] "
              "[--device npu|cuda|cpu]\n"
              "       python -m hyper_adaptor plan --world-size N --device-memory GiB [--device npu|cuda|cpu] "
              "[--top K] [--bound N] [--all] <model flags>\n"
              "       python -m hyper_adaptor checkpoint inspect DIR [--ckpt-step N] [-- <training flags>]\n"
              "       python -m hyper_adaptor mindspeed-flags --markdown")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in ("dry-run", "plan"):
        # nothing is built or run: megatron's import-time notices (apex, TransformerEngine absent, falling back)
        # say nothing about the prediction and would bury its first lines
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    if command == "describe":
        # the device choice is made at import, from --device-type if present
        sys.argv = [sys.argv[0]] + rest
        return describe(rest)
    if command == "dry-run":
        from hyper_adaptor.dryrun import report

        sys.argv = [sys.argv[0]] + rest
        return report.main(rest)
    if command == "plan":
        from hyper_adaptor.dryrun import plan

        sys.argv = [sys.argv[0]] + rest
        return plan.main(rest)
    if command == "checkpoint":
        from hyper_adaptor import checkpoint_cli

        sys.argv = [sys.argv[0]] + rest
        return checkpoint_cli.main(rest)
    if command == "mindspeed-flags":
        from hyper_adaptor import mindspeed_guide

        return mindspeed_guide.main(rest)
    print(f"unknown command {command!r}; known: describe, dry-run, plan, checkpoint, mindspeed-flags", file=sys.stderr)
    return 2
