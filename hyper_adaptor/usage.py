"""What a user typed, refused as argparse refuses a bad flag: one paragraph naming the flag, exit 2.

Three places turn bad input into that paragraph instead of a traceback:

* the parser megatron.training builds gets a one-line usage (:func:`on_parser`), so an argparse
  error is not buried under the usage line of every Megatron flag;
* :func:`check_ranges` refuses numbers megatron would divide by, count with or compare against
  (``--context-parallel-size 0`` is a ZeroDivisionError in megatron's own checks, ``--lr nan`` trains
  nothing) before any feature or megatron looks at them;
* :func:`explain` turns what the argument checks raise — a feature's FeatureConfigError, an
  assertion or ValueError in megatron's ``validate_args`` — into a message naming the flags; a failure
  in hyper_adaptor's own code is not input and keeps its traceback.

The wrap of ``validate_args`` (:func:`patch`) puts these in front of a real training script; ``python
-m hyper_adaptor describe`` calls them itself.
"""

from __future__ import annotations

import argparse
import functools
import linecache
import math
import os
import re
import sys
import traceback

from hyper_adaptor.features import FeatureConfigError
from hyper_adaptor.patch_manager import Patch

FEATURE = "input_checks"
VALIDATE_ARGS = "megatron.training.arguments.validate_args"
USAGE = "%(prog)s [megatron and hyper_adaptor flags] (--help lists them)"

_BARE_PERCENT = re.compile(r"%(?!\(\w+\)[a-z])")  # every "%" but argparse's own %(name)s


class _AnyKey(dict):
    def __missing__(self, key):
        return ""


# dest -> the flag a user types, from the last parser megatron.training built (a dest's own spelling
# differs for negated flags: --no-bias-swiglu-fusion sets bias_swiglu_fusion)
_flags: dict[str, str] = {}

# Integers megatron divides by or counts with: 0 or a negative value fails later with a traceback,
# or runs nothing. None means "not given" (megatron's default or its own "required" check).
AT_LEAST_ONE = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "micro_batch_size", "global_batch_size",
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "seq_length", "max_position_embeddings", "vocab_size", "train_iters", "train_samples", "num_experts",
    "moe_router_topk", "log_interval", "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
)
AT_LEAST_ZERO = ("eval_iters", "eval_interval", "save_interval", "num_workers", "lr_warmup_iters", "seed")
# (dest, lowest, highest, highest included): finite numbers in a range; nan and inf pass no check
# megatron makes, and train on or fail in the first step
BOUNDED = (
    ("lr", 0.0, math.inf, False), ("min_lr", 0.0, math.inf, False), ("weight_decay", 0.0, math.inf, False),
    ("start_weight_decay", 0.0, math.inf, False), ("end_weight_decay", 0.0, math.inf, False),
    ("clip_grad", 0.0, math.inf, False), ("adam_beta1", 0.0, 1.0, False), ("adam_beta2", 0.0, 1.0, False),
    ("adam_eps", 0.0, math.inf, False), ("init_method_std", 0.0, math.inf, False),
    ("hidden_dropout", 0.0, 1.0, True), ("attention_dropout", 0.0, 1.0, True),
    ("lr_warmup_fraction", 0.0, 1.0, True), ("loss_scale", 0.0, math.inf, False),
    ("initial_loss_scale", 0.0, math.inf, False),
)
# names megatron's checks use for a value derived from one flag
ALIASES = {"transformer_pipeline_model_parallel_size": "pipeline_model_parallel_size"}
POSITIVE = ("adam_eps", "loss_scale", "initial_loss_scale")  # 0 is out too: megatron divides by them


class BadInput(ValueError):
    """A flag or a combination of flags the run cannot use; the message names them."""


def flag(dest: str) -> str:
    return _flags.get(dest) or "--" + dest.replace("_", "-")


def on_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A one-line usage for megatron's parser (argparse prints the usage before every error, and
    megatron's lists every one of its flags), and the dest -> flag spelling for the messages."""
    if parser.usage is None:
        parser.usage = USAGE
    for action in parser._actions:  # argparse keeps no public list of its actions
        long = [o for o in action.option_strings if o.startswith("--")]
        if long and action.dest not in _flags:
            _flags[action.dest] = long[0]
        # argparse %-formats every help text: a bare "%" ("10%)" in a megatron 0.19 help) makes --help raise
        if isinstance(action.help, str) and "%" in action.help:
            try:
                action.help % _AnyKey()
            except (ValueError, TypeError):
                action.help = _BARE_PERCENT.sub("%%", action.help)
    return parser


def model_parallel_size(args) -> int:
    return (getattr(args, "tensor_model_parallel_size", 1) * getattr(args, "pipeline_model_parallel_size", 1)
            * getattr(args, "context_parallel_size", 1))


def check_ranges(args, world_source: str = "WORLD_SIZE") -> None:
    """BadInput for the first number out of its range, and for a world size the model-parallel
    sizes do not divide."""
    for dest in AT_LEAST_ONE + AT_LEAST_ZERO:
        value = getattr(args, dest, None)
        least = 1 if dest in AT_LEAST_ONE else 0
        if value is not None and not isinstance(value, bool) and isinstance(value, int) and value < least:
            raise BadInput(f"argument {flag(dest)}: must be >= {least}; got {value}")
    for dest, low, high, high_included in BOUNDED:
        value = getattr(args, dest, None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        low_ok = value > low if dest in POSITIVE else value >= low
        high_ok = value <= high if high_included else value < high
        if not (math.isfinite(value) and low_ok and high_ok):
            lower = f"> {low:g}" if dest in POSITIVE else f">= {low:g}"
            upper = "" if math.isinf(high) else f" and {'<=' if high_included else '<'} {high:g}"
            raise BadInput(f"argument {flag(dest)}: must be a finite number {lower}{upper}; got {value}")
    world = getattr(args, "world_size", None)
    model = model_parallel_size(args)
    if world and world % model:
        raise BadInput(
            f"the world size {world} ({world_source}) is not divisible by {flag('tensor_model_parallel_size')} "
            f"{args.tensor_model_parallel_size} x {flag('pipeline_model_parallel_size')} "
            f"{args.pipeline_model_parallel_size} x {flag('context_parallel_size')} {args.context_parallel_size} "
            f"= {model}")
    _check_divisions(args, world, model, world_source)


def _check_divisions(args, world, model: int, world_source: str) -> None:
    """What megatron-core refuses only once the model or the batch schedule is built, inside a
    process group: the heads split over TP, the global batch over micro-batches x data-parallel."""
    tp = args.tensor_model_parallel_size
    heads = getattr(args, "num_attention_heads", None)
    if heads and heads % tp:
        raise BadInput(f"argument {flag('num_attention_heads')}: {heads} is not a multiple of "
                       f"{flag('tensor_model_parallel_size')} {tp} (each tensor-parallel rank holds whole heads)")
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    if groups and groups % tp and tp % groups:
        raise BadInput(f"argument {flag('num_query_groups')}: {groups} is neither a multiple nor a divisor of "
                       f"{flag('tensor_model_parallel_size')} {tp}")
    ffn = getattr(args, "ffn_hidden_size", None)
    if ffn and ffn % tp:
        raise BadInput(f"argument {flag('ffn_hidden_size')}: {ffn} is not a multiple of "
                       f"{flag('tensor_model_parallel_size')} {tp} (the MLP's columns are split over TP)")
    seq = getattr(args, "seq_length", None)
    if getattr(args, "sequence_parallel", False) and tp > 1 and seq and seq % tp:
        raise BadInput(f"argument {flag('seq_length')}: {seq} is not a multiple of "
                       f"{flag('tensor_model_parallel_size')} {tp}, which {flag('sequence_parallel')} splits it over")
    experts, topk = getattr(args, "num_experts", None), getattr(args, "moe_router_topk", None)
    if experts and topk and topk > experts:
        raise BadInput(f"argument {flag('moe_router_topk')}: {topk} is more than {flag('num_experts')} {experts}")
    gbs, mbs = getattr(args, "global_batch_size", None), getattr(args, "micro_batch_size", None)
    if world and gbs and mbs and not getattr(args, "decrease_batch_size_if_needed", False):
        dp = world // model
        if gbs % (mbs * dp):
            raise BadInput(
                f"argument {flag('global_batch_size')}: {gbs} is not divisible by {flag('micro_batch_size')} "
                f"{mbs} x the data-parallel size {dp} (world size {world} ({world_source}) / TP x PP x CP {model})")


def _in_megatron(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``error`` when it is in megatron's code (its checks), else None."""
    frames = traceback.extract_tb(error.__traceback__)
    if frames and f"{os.sep}megatron{os.sep}" in frames[-1].filename:
        return frames[-1]
    return None


def _statement(frame: traceback.FrameSummary) -> str:
    last = getattr(frame, "end_lineno", None) or frame.lineno
    lines = [linecache.getline(frame.filename, n) for n in range(frame.lineno, last + 1)]
    return " ".join(" ".join(lines).split())


def _named_flags(*texts: str) -> list[str]:
    """The flags that ``args.<dest>`` expressions, or dests spelt with an underscore, in ``texts``
    stand for (bare words such as "load" or "seed" are too often plain English)."""
    named = []
    for text in texts:
        for dest in re.findall(r"args\.([a-z_][a-z0-9_]*)|\b([a-z][a-z0-9]*_[a-z0-9_]+)\b", text):
            dest = dest[0] or dest[1]
            dest = ALIASES.get(dest, dest)
            if dest in _flags and flag(dest) not in named:
                named.append(flag(dest))
    return named


def explain(error: BaseException) -> str | None:
    """The message for an error the argument checks raised, or None when it is not about the input."""
    if isinstance(error, (FeatureConfigError, BadInput)):
        return str(error)
    frame = _in_megatron(error)
    if frame is None or not isinstance(error, (AssertionError, ValueError, TypeError, ZeroDivisionError,
                                               RuntimeError, ImportError, KeyError)):
        return None
    statement = _statement(frame)
    text = " ".join(str(error).split())
    if not text:
        text = statement[len("assert "):] if statement.startswith("assert ") else statement
    if not isinstance(error, AssertionError):
        text = f"{type(error).__name__}: {text}"
    named = [f for f in _named_flags(statement, text) if f not in text]
    where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return f"megatron's argument check failed: {text}" + (f" ({', '.join(named)})" if named else "") + \
        f" [megatron.training {where}]"


def fail(message: str, prog: str | None = None) -> None:
    """End the process as argparse does for a bad flag: one paragraph on stderr, exit status 2."""
    if prog is None:
        script = sys.argv[0] if sys.argv and sys.argv[0] else "python"
        name = os.path.basename(script)
        # python -m package: argv[0] is the package's __main__.py
        prog = os.path.basename(os.path.dirname(script)) if name == "__main__.py" else name
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _checking_input(original):
    @functools.wraps(original)
    def validate_args(args, defaults={}):  # noqa: B006  (megatron's own signature)
        try:
            check_ranges(args)
            return original(args, defaults)
        except Exception as error:
            message = explain(error)
            if message is None:
                raise
            fail(message)

    return validate_args


def patch(adaptor_feature: str) -> Patch:
    """Outside the adaptor's own wrap of validate_args, so its features' errors are caught too."""
    return Patch(VALIDATE_ARGS, _checking_input, "wrap", FEATURE, after=(adaptor_feature,))
