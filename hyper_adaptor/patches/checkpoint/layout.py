"""What a checkpoint records about the layout that saved it, and the check before loading it elsewhere.

A megatron ``torch_dist`` checkpoint already carries the whole layout: its common state (a small
object inside the DCP files, or ``common.pt`` in older ones) holds megatron's ``args`` namespace —
every parallel size, the optimizer and its wrapper, and hyper_adaptor's own flags — and its content
metadata holds the distributed optimizer's state format (``distrib_optim_sharding_type``). So the
record is read from there, without loading a tensor, and plain-megatron checkpoints are read the
same way. What megatron's files lack — the hyper_adaptor and megatron-core versions and the features
that were applied — rank 0 writes beside them (``hyper_adaptor.json``) from a wrap of
``dist_checkpointing.save``, the one call every torch_dist save goes through.

:func:`check_transition` is the one rule table: the load-time check (:func:`problems`, raised by the
checkpoint feature's validate before anything is built) and ``python -m hyper_adaptor checkpoint
inspect`` both ask it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import warnings
from dataclasses import dataclass, field

from hyper_adaptor.patches.checkpoint.survival import TRACKER

FEATURE = "checkpoint"
SIDECAR = "hyper_adaptor.json"
SAVE = "megatron.core.dist_checkpointing.save"
_ITER_DIR = re.compile(r"^(iter_\d{7}|release)$")

# megatron's distributed-optimizer formats keyed by its internal buckets: they move only where the
# buckets stay the same, i.e. across data (and context) parallel ranks
BUCKET_SPACE = ("dp_reshardable", "dp_zero_gather_scatter")
# the formats keyed by model parameters (megatron's DistributedOptimizer.checkpoint_fully_reshardable_formats)
MODEL_SPACE = ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor")

# the model's shape: a checkpoint holds tensors of this shape whatever the layout
SHAPE_FLAGS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels",
    "vocab_size": "--vocab-size",
    "num_experts": "--num-experts",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "swiglu": "--swiglu",
    "add_bias_linear": "--disable-bias-linear",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
}


class CheckpointError(ValueError):
    """A directory that is not a readable torch_dist checkpoint; the message says what is wrong with it."""


@dataclass
class Layout:
    """A parallel layout and the optimizer (state) it runs; the checkpoint fields are None for a run's."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1  # model chunks per pipeline rank
    schedule: str = "none"  # the pipeline schedule: megatron's (1f1b, interleaved) or hyper_adaptor's
    cp: int = 1
    cp_algo: str | None = None
    ep: int = 1
    etp: int = 1
    dp: int | None = None  # None: the world size is not known
    world: int | None = None
    optimizer: str = "adam"
    # who holds the optimizer state: "distributed" (megatron's distributed optimizer), "layer-wise"
    # (megatron's layer-wise distributed optimizer, Muon), "hsdp" (hyper_adaptor's HSDP) or "ddp"
    wrapper: str = "ddp"
    hsdp_level: str | None = None
    state_format: str | None = None  # the distributed optimizer's sharding type (from the checkpoint)
    has_optimizer_state: bool = True
    shape: dict = field(default_factory=dict)
    # read from a checkpoint only
    path: str | None = None
    iteration: int | None = None
    features: tuple[str, ...] | None = None  # None: not recorded (no sidecar)
    versions: dict | None = None
    args: object = field(default=None, repr=False, compare=False)  # the saved megatron namespace

    @property
    def placement(self) -> str:
        """Which layers each pipeline rank holds: megatron's loop over chunks, or ZBV's V."""
        return "V" if self.schedule == "zbv" else "loop"

    def parallel(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.pp > 1:
            parts.append(f"({self.schedule})")
        if self.cp > 1:
            parts.append(f"CP{self.cp}" + (f" ({self.cp_algo})" if self.cp_algo else ""))
        if self.ep > 1 or self.shape.get("num_experts"):
            parts.append(f"EP{self.ep}")
            if self.etp != self.tp:
                parts.append(f"ETP{self.etp}")
        parts.append(f"DP{self.dp if self.dp is not None else '?'}")
        return " ".join(parts)

    def model_parallel(self) -> str:
        """The layout less its data-parallel size (what a bucket-keyed optimizer state is tied to)."""
        return self.parallel().rsplit(" DP", 1)[0]

    def holder(self) -> str:
        """Who holds the optimizer state, and in which format where it has several."""
        if self.wrapper == "distributed":
            return "the distributed optimizer" + (f" ({self.state_format})" if self.state_format else "")
        if self.wrapper == "layer-wise":
            return "megatron's layer-wise distributed optimizer"
        if self.wrapper == "hsdp":
            return f"HSDP {self.hsdp_level}"
        return "megatron's DDP"

    def optimizer_state(self) -> str:
        if not self.has_optimizer_state:
            return "none (saved with --no-save-optim)"
        space = " (model space)" if self.wrapper in ("ddp", "hsdp") else ""
        return f"{self.optimizer}, held by {self.holder()}{space}"

    def __str__(self) -> str:
        return f"{self.parallel()} with {self.holder()}"


# -- reading ------------------------------------------------------------------------------------------------
def _int(value, default: int = 1) -> int:
    return int(value) if value else default


def _vpp(args) -> int:
    from hyper_adaptor.patches.pipeline import model_chunks

    return model_chunks(args)


def _shape(args) -> dict:
    shape = {dest: getattr(args, dest, None) for dest in SHAPE_FLAGS}
    if not getattr(args, "group_query_attention", False):
        shape["num_query_groups"] = None  # megatron ignores the flag then
    if shape["num_layers"] is None:
        shape["num_layers"] = getattr(args, "encoder_num_layers", None)
    shape["padded_vocab"] = getattr(args, "padded_vocab_size", None) or padded_vocab(
        args, _int(getattr(args, "tensor_model_parallel_size", 1)))
    return shape


def from_args(args, world: int | None = None, state_format: str | None = None) -> Layout:
    """The layout a megatron argument namespace describes — a run's (``world`` from its launcher) or
    a checkpoint's saved ``args`` (complete: megatron's checks had filled it)."""
    tp = _int(getattr(args, "tensor_model_parallel_size", 1))
    pp = _int(getattr(args, "pipeline_model_parallel_size", 1))
    cp = _int(getattr(args, "context_parallel_size", 1))
    world = world if world is not None else getattr(args, "world_size", None)
    vpp = _vpp(args)
    schedule = getattr(args, "pipeline_schedule", None) or ("interleaved" if vpp > 1 else "1f1b")
    optimizer = getattr(args, "optimizer", "adam") or "adam"
    layer_wise = getattr(args, "use_layer_wise_distributed_optimizer", False)
    if optimizer == "dist_muon":  # megatron's deprecated spelling, turned into these two by its checks
        optimizer, layer_wise = "muon", True
    if optimizer not in ("adam", "sgd") and getattr(args, "use_distributed_optimizer", False):
        layer_wise = True  # megatron's checks will switch the distributed optimizer to the layer-wise one
    if getattr(args, "use_hsdp", False):
        wrapper = "hsdp"
    elif layer_wise:
        wrapper = "layer-wise"
    elif getattr(args, "use_distributed_optimizer", False):
        wrapper = "distributed"
    else:
        wrapper = "ddp"
    return Layout(
        tp=tp, pp=pp, vpp=vpp, schedule=schedule if pp > 1 else "none", cp=cp,
        cp_algo=getattr(args, "context_parallel_algo", None) if cp > 1 else None,
        ep=_int(getattr(args, "expert_model_parallel_size", 1)),
        etp=_int(getattr(args, "expert_tensor_parallel_size", None), tp),
        dp=world // (tp * pp * cp) if world else None, world=world,
        optimizer=optimizer, wrapper=wrapper,
        hsdp_level=getattr(args, "hsdp_optimizer_level", None) if wrapper == "hsdp" else None,
        state_format=state_format if wrapper in ("distributed", "layer-wise") else None,
        has_optimizer_state=not getattr(args, "no_save_optim", False),
        shape=_shape(args),
    )


def iteration_dir(directory: str, step: int | None = None) -> str | None:
    """The iteration directory megatron would load from ``directory`` (``--ckpt-step`` first, else the
    tracker), ``directory`` itself when it is one, or None when there is no checkpoint there."""
    if os.path.isfile(os.path.join(directory, "metadata.json")) or os.path.isfile(
            os.path.join(directory, "common.pt")):
        return directory
    if step is not None:
        return os.path.join(directory, f"iter_{step:07d}")
    tracker = os.path.join(directory, TRACKER)
    if not os.path.isfile(tracker):
        return None
    # the checkpoint a start resumes from is survival's choice (a torn newest save is skipped): the check
    # and inspect read that one, not whatever the tracker names
    from hyper_adaptor.patches.checkpoint import survival

    chosen, _ = survival.choose(directory)
    if chosen is not None:
        return os.path.join(directory, f"iter_{chosen:07d}")
    named, why_not = survival.parse_tracker(tracker)
    if why_not is not None:
        raise CheckpointError(f"{tracker}: {why_not}, and no complete checkpoint is beside it")
    # nothing complete: the directory the tracker names, for what is wrong with it
    return os.path.join(directory, "release" if named == 0 else f"iter_{named:07d}")


def _common_state(path: str) -> dict:
    metadata = os.path.join(path, "metadata.json")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.isfile(metadata):
        raise CheckpointError(f"{path} is not a torch_dist checkpoint (no metadata.json: a legacy --ckpt-format "
                              f"torch checkpoint or an incomplete save)")
    try:
        with open(metadata) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{metadata} is not readable: {error}") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{path} is not a torch_dist checkpoint (its metadata.json names the sharded backend "
                              f"{backend!r}); only torch_dist checkpoints are read")
    if not any(os.path.isfile(os.path.join(path, name)) for name in (".metadata", "common.pt")):
        raise CheckpointError(f"{path}: an incomplete save (no .metadata of torch's DCP, no common.pt)")
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    try:
        with warnings.catch_warnings():
            # read in one process on purpose (at start-up, before the process group exists)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return load_common_state_dict(path)
    except (Exception, CheckpointException) as error:  # torn or foreign: said as such, never a traceback
        raise CheckpointError(f"{path}: its common state (megatron's args) cannot be read: "
                              f"{type(error).__name__}: {error}") from None


def read(directory: str, step: int | None = None) -> Layout:
    """The layout, iteration, versions and features of the checkpoint megatron would load from
    ``directory`` (a --load / --save directory, or one iteration directory). Reads no tensor."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such directory")
    path = iteration_dir(directory, step)
    if path is None:
        raise CheckpointError(f"{directory} holds no checkpoint (no {TRACKER}, no iteration directory named)")
    common = _common_state(path)
    args = common.get("args")
    if args is None:
        raise CheckpointError(f"{path}: its common state has no megatron args (not saved by megatron.training)")
    metadata = common.get("content_metadata") or {}
    layout = from_args(args, state_format=metadata.get("distrib_optim_sharding_type"))
    if layout.wrapper == "distributed" and layout.state_format is None:
        # checkpoints older than megatron's content metadata: its own fallback
        layout.state_format = ("fully_sharded_model_space" if getattr(args, "ckpt_fully_parallel_save", False)
                               else "dp_zero_gather_scatter")
    layout.path = path
    layout.iteration = common.get("iteration", getattr(args, "iteration", None))
    sidecar = _read_sidecar(path)
    layout.versions = sidecar.get("versions")
    layout.features = tuple(sidecar["features"]) if "features" in sidecar else None
    layout.args = args
    return layout


def _read_sidecar(path: str) -> dict:
    try:
        with open(os.path.join(path, SIDECAR)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


# -- the rule table ------------------------------------------------------------------------------------------
def check_transition(saved: Layout, target: Layout, load_optimizer: bool = True) -> list[str]:
    """Why the checkpoint ``saved`` cannot load under ``target`` (empty: it can). ``load_optimizer``
    False (--no-load-optim, --finetune) loads the model only: the optimizer rules do not apply."""
    name = f"checkpoint {saved.path}" if saved.path else "the checkpoint"
    problems = []
    for dest, flag in SHAPE_FLAGS.items():
        old, new = saved.shape.get(dest), target.shape.get(dest)
        if old is not None and new is not None and old != new:
            problems.append(f"{flag}: {name} holds a model with {_value(dest, old)}, this run builds "
                            f"{_value(dest, new)}: its weights do not fit; use the checkpoint's {flag} value")
    old, new = saved.shape.get("padded_vocab"), target.shape.get("padded_vocab")
    if old and new and old != new and saved.shape.get("vocab_size") == target.shape.get("vocab_size"):
        problems.append(f"--make-vocab-size-divisible-by: {name} holds a vocabulary padded to {old} rows (TP"
                        f"{saved.tp}), this run pads it to {new} (--vocab-size padded to a multiple of "
                        f"--make-vocab-size-divisible-by x TP{target.tp}); choose --make-vocab-size-divisible-by "
                        f"so that both pad to the same size")
    if not load_optimizer or not saved.has_optimizer_state:
        return problems
    head = f"{name} was saved at {saved} and cannot load at {target}"
    skip = "or load with --no-load-optim (the model only, a fresh optimizer)"
    if saved.optimizer != target.optimizer:
        problems.append(f"{head}: its optimizer state is {saved.optimizer}'s and this run's --optimizer is "
                        f"{target.optimizer}; use --optimizer {saved.optimizer}, {skip}")
        return problems
    moved = _moved(saved, target)
    if saved.wrapper == "layer-wise" or target.wrapper == "layer-wise":
        if saved.wrapper != target.wrapper:
            problems.append(f"{head}: megatron's layer-wise distributed optimizer (--optimizer {saved.optimizer} "
                            f"with --use-distributed-optimizer) saves its own structure, which neither other "
                            f"optimizer wrapper reads; {_same_wrapper(saved)}, {skip}")
        elif moved or (target.dp is not None and saved.dp != target.dp):
            problems.append(f"{head}: megatron's layer-wise distributed optimizer saves for one fixed layout "
                            f"(it changed: {', '.join(moved or ['DP'])}); load at {saved.parallel()}, {skip}")
        return problems
    if saved.wrapper == "distributed" and saved.state_format in BUCKET_SPACE:
        if target.wrapper != "distributed":
            problems.append(f"{head}: its optimizer state is keyed by the distributed optimizer's buckets "
                            f"({saved.state_format}), which only the distributed optimizer reads; run with "
                            f"--use-distributed-optimizer, or re-save it from a run at {saved.model_parallel()} with "
                            f"--dist-ckpt-optim-fully-reshardable, {skip}")
        elif moved:
            problems.append(f"{head}: its optimizer state ({saved.state_format}) only moves across data "
                            f"parallel (it changed: {', '.join(moved)}); re-save it from a run at "
                            f"{saved.model_parallel()} with --dist-ckpt-optim-fully-reshardable, {skip}")
        return problems
    # the fully-reshardable format and the per-parameter optimizers' (megatron's DDP, HSDP) hold the same
    # model-space tensors: patches/checkpoint/optimizer_formats.py converts the rest, either way
    if saved.wrapper == "distributed" and target.wrapper != "distributed" and saved.state_format != "fully_reshardable":
        problems.append(f"{head}: its optimizer state ({saved.state_format}) reaches megatron's DDP and HSDP "
                        f"only from the distributed optimizer's fully_reshardable format; run with "
                        f"--use-distributed-optimizer, or re-save it with --dist-ckpt-optim-fully-reshardable, {skip}")
    return problems


def padded_vocab(args, tp: int) -> int | None:
    """The embedding's rows megatron builds: --vocab-size padded to --make-vocab-size-divisible-by x TP."""
    vocab = getattr(args, "vocab_size", None)
    if not vocab:
        return None
    multiple = (getattr(args, "make_vocab_size_divisible_by", None) or 128) * tp
    return -(-vocab // multiple) * multiple


def _moved(saved: Layout, target: Layout) -> list[str]:
    """What changed of the layout a bucket-keyed optimizer state depends on (DP and CP aside: it is
    sharded over both, so they may change)."""
    moved = []
    sizes = [("TP", saved.tp, target.tp), ("PP", saved.pp, target.pp), ("VPP", saved.vpp, target.vpp)]
    if saved.shape.get("num_experts"):  # without experts the expert sizes shape nothing
        sizes += [("EP", saved.ep, target.ep), ("expert TP", saved.etp, target.etp)]
    for name, old, new in sizes:
        if old != new:
            moved.append(f"{name} {old} -> {new}")
    if saved.vpp > 1 and saved.vpp == target.vpp and saved.placement != target.placement:
        moved.append(f"the layers' placement {saved.schedule} -> {target.schedule}")
    if saved.wrapper == "layer-wise" and saved.cp != target.cp:
        moved.append(f"CP {saved.cp} -> {target.cp}")
    return moved


def _same_wrapper(saved: Layout) -> str:
    if saved.wrapper == "layer-wise":
        return f"load it with --optimizer {saved.optimizer} --use-distributed-optimizer at {saved.parallel()}"
    return "load it without --use-distributed-optimizer"


def command_line(shape: dict) -> str:
    """The model-shape flags as a command line gives them."""
    words = []
    for dest, value in shape.items():
        if value is None or dest not in SHAPE_FLAGS:
            continue
        if dest == "add_bias_linear":
            words += [] if value else [SHAPE_FLAGS[dest]]
        elif isinstance(value, bool):
            words += [SHAPE_FLAGS[dest]] if value else []
        else:
            words.append(f"{SHAPE_FLAGS[dest]} {value}")
    return " ".join(words)


def _value(dest: str, value) -> str:
    if isinstance(value, bool):
        return f"{SHAPE_FLAGS[dest]} {'on' if value else 'off'}" if dest != "add_bias_linear" else (
            f"linear biases {'on' if value else 'off'}")
    return f"{SHAPE_FLAGS[dest]} {value}"


# -- at start-up ---------------------------------------------------------------------------------------------
def loads_optimizer(args) -> bool:
    return not (getattr(args, "no_load_optim", False) or getattr(args, "finetune", False))


def problems(args) -> list[str]:
    """Why the checkpoint --load points at cannot load under ``args`` (empty: it can, or there is
    nothing to check). No checkpoint there, or one this cannot read (not torch_dist, torn), is left
    to megatron's loader (and to the restart path, which skips a torn one)."""
    directory = getattr(args, "load", None)
    if not directory or not os.path.isdir(directory):
        return []
    try:
        saved = read(directory, getattr(args, "ckpt_step", None))
    except CheckpointError:
        return []
    world = getattr(args, "world_size", None) or _int(os.environ.get("WORLD_SIZE"), 0) or None
    return check_transition(saved, from_args(args, world=world), loads_optimizer(args))


def sidecar(args, features) -> dict:
    """What ``hyper_adaptor.json`` holds beside a checkpoint saved with these arguments."""
    from hyper_adaptor import megatron_version

    found = megatron_version.detect()
    # the package is imported before any of its modules: its version is read, not imported (the
    # package itself sits above the patches)
    package = sys.modules[__name__.split(".")[0]]
    return {
        "versions": {"hyper_adaptor": getattr(package, "__version__", None),
                     "megatron_core": found.version if found else None},
        "features": list(features),
        "layout": from_args(args).parallel(),
    }


def _writing_sidecar(args, features):
    record = sidecar(args, features)

    def factory(original):
        @functools.wraps(original)
        def save(sharded_state_dict, checkpoint_dir, *rest, **kwargs):
            result = original(sharded_state_dict, checkpoint_dir, *rest, **kwargs)
            if _ITER_DIR.match(os.path.basename(os.path.normpath(str(checkpoint_dir)))) and _rank() == 0:
                with open(os.path.join(checkpoint_dir, SIDECAR), "w") as f:
                    json.dump(record, f, indent=1)
            return result

        return save

    return factory


def _rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def patches(args, features=()) -> list:
    """Rank 0 writes ``hyper_adaptor.json`` (versions, ``features``: the ones this run applied) into
    every iteration directory it saves."""
    from hyper_adaptor.patch_manager import Patch

    if not getattr(args, "save", None):
        return []
    return [Patch(SAVE, _writing_sidecar(args, features), "wrap", FEATURE)]
