"""The feature contract (docs/contract.md), held against every feature with all of their flags on.

Two command lines between them enable every feature in ``FEATURES`` (HSDP switches gradient-accumulation
fusion off, so the second runs without it). For each: ``adjust`` says every change it makes and every
flag it hides or takes, in its own notices; ``validate`` changes nothing; ``patches`` is pure (same
patches twice, nothing kept on the feature, in a module or on ``args``); ``asked_explicitly`` agrees with
``requested``; flags follow megatron's conventions; one feature per file.
"""

from __future__ import annotations

import ast
import copy
import inspect
import re
import sys
import textwrap
import types

import pytest

import hyper_adaptor.megatron_adaptor  # noqa: F401  (bootstrap: megatron's parser gets the flags)
from hyper_adaptor import features
from hyper_adaptor.features import FEATURES, Feature, base
from tests.unit.test_adaptor import megatron_args

MODEL = ("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "20",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope")
EVERY = MODEL + (
    "--deterministic-mode", "--profile", "--profile-with-cpu",
    "--fused-backend", "eager", "--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb",
    "--use-flash-attn", "--num-experts", "4", "--moe-grouped-gemm",
    "--context-parallel-size", "2", "--context-parallel-algo", "hybrid", "--ulysses-degree-in-cp", "2",
    "--attention-dropout", "0",
    "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
    "--untie-embeddings-and-output-weights",
    "--swap-attention", "--swap-prefetch-layers", "2",
    "--recompute-norm", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
)
COMMAND_LINES = {
    "hsdp": EVERY + ("--use-hsdp", "--fp16", "--pipeline-schedule", "interleaved", "--cpu-offloading-num-layers", "1"),
    # without HSDP: gradient-accumulation fusion stays on; fine-grained offloading instead of the first
    # layers (--recompute-activation-function wraps the MLP those would swap whole)
    "ddp": EVERY + (
        "--bf16", "--pipeline-schedule", "zbv", "--fine-grained-activation-offloading",
        "--moe-token-dispatcher-type", "alltoall", "--moe-dispatcher-engine", "hyper",
        "--offload-modules", "attn_norm", "core_attn", "--recompute-activation-function", "--save", "checkpoints"),
    # Muon cannot be combined with --optimizer-cpu-offload (the host optimizer serves adam and sgd)
    "muon": EVERY[:EVERY.index("--optimizer-cpu-offload")] + (
        "--optimizer", "muon", "--use-hsdp", "--bf16", "--muon-tp-mode", "distributed"),
}
KEBAB = re.compile(r"^--[a-z0-9]+(-[a-z0-9]+)*$")
# on by default in megatron: requested whenever megatron's default is, never "asked" (documented there)
NOT_ASKED_BY_DEFAULT = {"grad_accum_fusion"}


def _parsed(line: str, tmp_path):
    args = megatron_args(*COMMAND_LINES[line], "--profile-save-path", str(tmp_path / "traces"))
    args.rank, args.world_size = 0, 1
    return args


def _changes(before: dict, after: dict) -> set[str]:
    return {k for k in set(before) | set(after) if before.get(k, object()) != after.get(k, object())} - {base.RECORD}


def _adjusted(line: str, tmp_path):
    """adjust of every enabled feature as the adaptor runs it; {feature: (notices, dests it changed)}."""
    args = _parsed(line, tmp_path)
    said = {}
    for feature in FEATURES:
        if feature.is_enabled(args):
            before = copy.deepcopy(vars(args))
            hidden_before = set(base.taken(args))
            notices = feature.adjust(args)
            said[feature.name] = (notices, _changes(before, vars(args)) | (set(base.taken(args)) - hidden_before))
    return args, said


_ENABLED: dict[str, set[str]] = {}


def _enabled(line: str, tmp_path) -> set[str]:
    if line not in _ENABLED:
        args, _ = _adjusted(line, tmp_path)
        _ENABLED[line] = {f.name for f in FEATURES if f.is_enabled(args)}
    return _ENABLED[line]


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def test_the_command_lines_enable_every_feature(tmp_path):
    enabled = set().union(*(_enabled(line, tmp_path) for line in COMMAND_LINES))
    assert enabled == {f.name for f in FEATURES}


@pytest.mark.parametrize("line", COMMAND_LINES)
def test_adjust_says_every_change_and_every_flag_it_hides_or_takes(line, tmp_path):
    args, said = _adjusted(line, tmp_path)
    for name, (notices, changed) in said.items():
        for dest in changed:  # the feature's own notices name each flag it changed, hid or took
            assert any(_flag(dest) in n for n in notices), (name, _flag(dest), notices)
    # the record is one plain dict on the namespace (megatron prints, copies and checkpoints it)
    record = getattr(args, base.RECORD)
    assert type(record) is dict and set(record) == {"hidden", "taken"}
    offload = {"optimizer_cpu_offload"} if "--optimizer-cpu-offload" in COMMAND_LINES[line] else set()
    assert {"deterministic_mode", "moe_grouped_gemm"} | offload <= set(record["hidden"])
    assert "profile" in record["taken"]
    for dest, value in base.taken(args).items():
        assert base.asked(args, dest) == value and getattr(args, dest) in (False, [])
    hidden, taken = dict(record["hidden"]), dict(record["taken"])
    base.restore_hidden(args)
    assert all(getattr(args, dest) == value for dest, value in hidden.items())
    assert all(getattr(args, dest) in (False, []) and base.asked(args, dest) == v for dest, v in taken.items())


@pytest.mark.parametrize("line", COMMAND_LINES)
def test_validate_only_checks(line, tmp_path):
    args, _ = _adjusted(line, tmp_path)
    adjusted = copy.deepcopy(vars(args))
    enabled = [f for f in FEATURES if f.is_enabled(args)]
    for feature in reversed(enabled):  # any order
        feature.validate(args)
        assert vars(args) == adjusted, feature.name


def _module_state() -> dict:
    """What a patches() call could leave behind in the feature and patch modules: their globals (the
    contents of containers, the identity of anything else)."""
    state = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(("hyper_adaptor.features", "hyper_adaptor.patches")) or module is None:
            continue
        for key, value in vars(module).items():
            if isinstance(value, (types.ModuleType, types.FunctionType, type)) or key.startswith("__"):
                continue
            state[f"{name}.{key}"] = copy.copy(value) if isinstance(value, (dict, list, set)) else id(value)
    return state


def _summary(patches) -> list:
    return [(p.target, p.kind, p.feature, p.after, p.rebind_in) for p in patches]


def _line_enabling(name: str, tmp_path) -> str:
    return next(line for line in COMMAND_LINES if name in _enabled(line, tmp_path))


@pytest.mark.parametrize("name", [f.name for f in FEATURES])
def test_patches_is_pure(name, tmp_path):
    feature = features.get(name)
    args, _ = _adjusted(_line_enabling(name, tmp_path), tmp_path)
    base.restore_hidden(args)
    namespace, instance, modules = copy.deepcopy(vars(args)), copy.deepcopy(vars(feature)), _module_state()
    first = feature.patches(args)
    assert vars(args) == namespace, "patches() changed args"
    assert vars(feature) == instance, "patches() kept state on the feature"
    changed = {k for k, v in _module_state().items() if modules.get(k, v) != v}
    assert not changed, f"patches() changed module state: {sorted(changed)}"
    assert _summary(feature.patches(args)) == _summary(first)


@pytest.mark.parametrize("line", [*COMMAND_LINES, "none"])
def test_asked_explicitly_agrees_with_requested(line, tmp_path):
    args = megatron_args(*MODEL) if line == "none" else _parsed(line, tmp_path)
    for stage in ("parsed", "adjusted"):
        for feature in FEATURES:
            requested, asked = feature.requested(args), feature.asked_explicitly(args)
            assert requested or not asked, (stage, feature.name)  # asked implies requested
            if requested and not feature.always_on and feature.name not in NOT_ASKED_BY_DEFAULT and line != "none":
                assert asked, (stage, feature.name)
        if line != "none":
            args, _ = _adjusted(line, tmp_path)


def _overrides(cls: type, method: str):
    for klass in cls.__mro__:
        if klass is Feature:
            return None
        if method in vars(klass):
            return vars(klass)[method]
    return None


@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.name)
def test_no_override_repeats_the_default(feature):
    """An ``asked_explicitly`` that only returns ``requested`` is what the base class does already."""
    method = _overrides(type(feature), "asked_explicitly")
    if method is None:
        return
    body = ast.parse(textwrap.dedent(inspect.getsource(method))).body[0].body
    body = [node for node in body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    returns_requested = (len(body) == 1 and isinstance(body[0], ast.Return)
                         and isinstance(body[0].value, ast.Call)
                         and getattr(body[0].value.func, "attr", None) == "requested")
    assert not returns_requested, f"{feature.name}: drop the override, the base class's asked_explicitly does it"


def test_flags_follow_megatrons_conventions():
    parsed = vars(megatron_args())
    owners = {}
    for feature in FEATURES:
        assert feature.name and feature.summary and feature.level in (0, 1, 2), feature.name
        for flag in feature.flags:
            assert KEBAB.match(flag.name), (feature.name, flag.name)
            assert flag.help.strip(), (feature.name, flag.name)
            assert flag.dest not in owners, f"{flag.name}: declared by {owners.get(flag.dest)} and {feature.name}"
            owners[flag.dest] = feature.name
            assert flag.dest in parsed, f"{flag.name} ({feature.name}) is not in megatron's parser"
            if flag.owner == "hyper_adaptor":
                # what a namespace built without the parser gets (fill_defaults) is what the parser gives
                assert parsed[flag.dest] == flag.default(), flag.name


def test_one_feature_per_file_named_after_it():
    modules = {}
    for feature in FEATURES:
        module = type(feature).__module__
        assert module == f"hyper_adaptor.features.{feature.name}", (feature.name, module)
        modules[module] = feature.name
    for name, module in list(sys.modules.items()):
        if name.startswith("hyper_adaptor.features.") and module is not None:
            defined = [c for c in vars(module).values()
                       if isinstance(c, type) and issubclass(c, Feature) and c is not Feature
                       and c.__module__ == name]
            assert len(defined) <= 1, (name, defined)
