"""``python -m hyper_adaptor checkpoint inspect DIR [--ckpt-step N] [-- <megatron flags> [--world-size N]]``.

Prints what a torch_dist checkpoint was saved with — layout, iteration, optimizer-state format,
hyper_adaptor features, versions — read from megatron's common state and hyper_adaptor's sidecar
without loading a tensor (hyper_adaptor/patches/checkpoint/layout.py). Given a command line after
``--``, it says whether that run can load it, with the same check a training run makes before it
builds anything: exit status 0 when it can, 2 when it cannot or the input is bad.
"""

from __future__ import annotations

import argparse
import sys

PROG = "hyper_adaptor checkpoint inspect"

# what each optimizer-state holder lets move, for the summary line
_MOVES = {
    "ddp": "anywhere: TP, PP, VPP / ZBV, CP, EP, DP; to --use-hsdp at any level and to --use-distributed-optimizer",
    "hsdp": "anywhere: TP, PP, VPP / ZBV, CP, EP, DP, HSDP levels; to megatron's DDP and to "
            "--use-distributed-optimizer",
    "layer-wise": "nowhere: megatron's layer-wise distributed optimizer loads at the layout that saved it",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Show the layout a torch_dist checkpoint was saved with, and whether a command line can load it.",
        epilog="Flags after -- are a training command line (megatron's and hyper_adaptor's, plus --world-size N); "
               "with them the exit status is 0 when that run can load the checkpoint, 2 when it cannot.")
    parser.add_argument("directory", metavar="DIR", help="a --save / --load directory, or one iter_NNNNNNN in it")
    parser.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                        help="the iteration to inspect (default: the one latest_checkpointed_iteration.txt names)")
    return parser


def _moves(saved) -> str:
    if saved.wrapper != "distributed":
        return _MOVES[saved.wrapper]
    from hyper_adaptor.patches.checkpoint.layout import BUCKET_SPACE

    if saved.state_format in BUCKET_SPACE:
        return ("across DP and CP only, under --use-distributed-optimizer (re-save with "
                "--dist-ckpt-optim-fully-reshardable to move TP, PP, VPP / ZBV, EP)")
    if saved.state_format == "fully_reshardable":
        return ("anywhere: TP, PP, VPP / ZBV, CP, EP, DP, under --use-distributed-optimizer, megatron's DDP or "
                "--use-hsdp at any level")
    return "anywhere under --use-distributed-optimizer: TP, PP, VPP / ZBV, CP, EP, DP"


def _command_line(flags: list[str]):
    """The training command line's arguments, checked as a run checks them, and its world size
    (None when neither --world-size nor WORLD_SIZE gives it) with where it came from."""
    from hyper_adaptor import cli, megatron_adaptor, usage

    args = cli._parse_megatron_flags(flags)
    world, source = cli._world_size(args)
    load, args.load = args.load, None  # the check is made once, below, with its problems listed
    try:
        cli._validate(megatron_adaptor.ADAPTOR, args, world, source)
    except Exception as error:
        message = usage.explain(error)
        if message is None:
            raise
        usage.fail(message, PROG)
    args.load = load
    return args, world, source


def inspect(argv: list[str], out=None) -> int:
    from hyper_adaptor import megatron_adaptor, usage  # noqa: F401  (level 0 before megatron is imported)
    from hyper_adaptor.patches.checkpoint import layout

    out = out or sys.stdout
    flags = None
    if "--" in argv:
        cut = argv.index("--")
        argv, flags = argv[:cut], argv[cut + 1:]
    options = _parser().parse_args(argv)
    args = None
    step = options.ckpt_step
    if flags is not None:
        args, world, source = _command_line(flags)
        if step is None:
            step = args.ckpt_step  # the iteration that run would load
    try:
        saved = layout.read(options.directory, step)
    except layout.CheckpointError as error:
        usage.fail(str(error), PROG)
    if saved.features is None:  # saved before hyper_adaptor recorded them: what its saved flags applied
        from hyper_adaptor.features.checkpoint import applied_features

        saved.features = applied_features(saved.args)
    versions = saved.versions or {}
    print(f"checkpoint {saved.path}", file=out)
    print(f"  iteration        {saved.iteration}", file=out)
    print(f"  saved at         {saved.parallel()} (world {saved.world})", file=out)
    print(f"  optimizer state  {saved.optimizer_state()}", file=out)
    if saved.has_optimizer_state:
        print(f"  it moves         {_moves(saved)}; the weights move to any layout of the same model", file=out)
    print(f"  features         {', '.join(saved.features) if saved.features else '(none)'}", file=out)
    if versions:
        print(f"  versions         hyper_adaptor {versions.get('hyper_adaptor')}, "
              f"megatron-core {versions.get('megatron_core')}", file=out)
    else:
        print(f"  versions         not recorded (no {layout.SIDECAR}: saved without hyper_adaptor's checkpoint "
              f"feature)", file=out)
    print(f"  model            {layout.command_line(saved.shape)}", file=out)
    if args is None:
        return 0
    note = f"world size {world}, from {source}"
    if world is None:
        # the checkpoint's data-parallel size, so that only what the command line says is compared
        world = usage.model_parallel_size(args) * (saved.dp or 1)
        note = f"world size not given (--world-size N or WORLD_SIZE): {world} assumed, the checkpoint's DP"
    target = layout.from_args(args, world=world)
    load_optimizer = layout.loads_optimizer(args)
    print(f"\nthis command line: {target}", file=out)
    print(f"  {note}", file=out)
    problems = layout.check_transition(saved, target, load_optimizer)
    if not problems:
        what = "model and optimizer state" if load_optimizer and saved.has_optimizer_state else "the model only"
        print(f"can load: yes ({what})", file=out)
        return 0
    print("can load: no", file=out)
    for problem in problems:
        print(f"  - {problem}", file=out)
    return 2


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m hyper_adaptor checkpoint inspect DIR [--ckpt-step N] "
              "[-- <training flags> [--world-size N]]")
        return 0 if argv else 2
    if argv[0] != "inspect":
        print(f"unknown checkpoint command {argv[0]!r}; known: inspect", file=sys.stderr)
        return 2
    return inspect(argv[1:])
