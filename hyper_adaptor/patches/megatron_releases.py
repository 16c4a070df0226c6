"""Where megatron-core releases differ at the seams hyper_adaptor patches or calls, against 0.19.2.

One record (``SEAMS``) read three ways: the patches that adapt to a moved seam name their target from it
(each adapts by looking at what the installed function takes, not at a version string), ``describe``
prints the entries whose probe answers differently in the megatron-core it found (``report``), and
tests/unit/test_megatron_versions.py checks that on 0.19.x no entry differs and on the Megatron-LM main
snapshot each one does. A probe reads megatron's source (``ast``), imports nothing and is not fooled by
an applied patch.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

REFERENCE = "0.19.2"


@dataclass(frozen=True)
class Seam:
    target: str  # dotted megatron name (a function, method or class; for a flag, the parser function)
    used_by: str  # the hyper_adaptor feature or module relying on it
    probe: tuple  # ("param", name) | ("method", name) | ("decorated", name) | ("default", flag)
    reference: object  # the probe's answer on 0.19.2
    change: str  # how the newer form differs
    handling: str  # what hyper_adaptor does about it


BIAS_SWIGLU = "megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl"
APPLY_ROPE = "megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb"

SEAMS = (
    Seam(BIAS_SWIGLU, "fused_swiglu (replace)", ("param", "clamp_value"), False,
         "gained clamp_value, which the MLP passes positionally (config.activation_func_clamp_value)",
         "the replacement takes it; a clamp that is set runs the clamped SwiGLU in torch ops"),
    Seam(APPLY_ROPE, "fused_rope (wrap)", ("param", "inverse"), False,
         "gained inverse, mla_output_remove_interleaving and max_seqlen (attention passes max_seqlen=)",
         "the wrap takes the new keywords; a call that needs one (inverse, MLA output, packed sequences) "
         "goes to megatron's own function"),
    Seam("megatron.core.tensor_parallel.random.CheckpointWithoutOutput.__init__", "compat (wrap)",
         ("param", "ckpt_manager"), False, "gained ckpt_manager and retain_input_tensors",
         "none needed: the wrap passes every argument through"),
    Seam("megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.forward",
         "pipeline split-dW (wrap of its backward)", ("param", "output_dtype"), False,
         "gained output_dtype; backward casts grad_output to the input's dtype first",
         "the deferred weight gradient uses grad_output in the input's dtype where the context records it"),
    Seam("megatron.core.tensor_parallel.layers.LinearWithFrozenWeight.forward", "none",
         ("param", "output_dtype"), False, "gained output_dtype", "none needed: hyper_adaptor does not patch it"),
    Seam("megatron.core.transformer.transformer_layer.TransformerLayer", "none",
         ("method", "_apply_mlp_bda_step"), False,
         "_forward_post_mlp split (bias-dropout-add step now _apply_mlp_bda_step, MoE router / experts / "
         "postprocess methods)", "none needed: hyper_adaptor patches no TransformerLayer method"),
    Seam("megatron.core.pipeline_parallel.schedules.forward_step", "pipeline schedules (calls)",
         ("decorated", "_otel_trace_fn"), False,
         "forward_step / backward_step decorated by a telemetry tracer (a no-op without nemo-lens)",
         "none needed: called through the module attribute, traced or not"),
    Seam("megatron.training.arguments._add_regularization_args", "muon (megatron's config -> tp_mode)",
         ("default", "--muon-tp-mode"), "blockwise",
         "--muon-tp-mode defaults to duplicated (0.19.2: blockwise)",
         "hyper_adaptor's Muon takes the mode megatron derives: with TP > 1 and no --muon-tp-mode it now "
         "orthogonalises the whole matrix; pass --muon-tp-mode blockwise for 0.19.2's updates"),
)


def _source(root: Path, dotted: str) -> tuple[ast.Module, list[str]] | None:
    """The parsed module holding ``dotted`` under ``root`` and the remaining attribute path."""
    parts = dotted.split(".")
    for depth in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:depth])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return _parse(str(path)), parts[depth:]
    return None


@functools.lru_cache(maxsize=64)
def _parse(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8"))


def _definition(tree: ast.Module, names: list[str]):
    node = tree
    for name in names:
        node = next((n for n in getattr(node, "body", []) if isinstance(n, ast.FunctionDef | ast.ClassDef)
                     and n.name == name), None)
        if node is None:
            return None
    return node


def _flag_default(tree: ast.AST, flag: str):
    for call in ast.walk(tree):
        if (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_argument" and call.args
                and isinstance(call.args[0], ast.Constant) and call.args[0].value == flag):
            default = next((k.value for k in call.keywords if k.arg == "default"), None)
            return default.value if isinstance(default, ast.Constant) else None
    return None


def probe(seam: Seam, root: Path):
    """The seam's probe answered from the megatron tree at ``root`` (the directory holding ``megatron/``);
    None when the target is not there at all."""
    found = _source(root, seam.target)
    if found is None:
        return None
    tree, rest = found
    node = _definition(tree, rest)
    kind, name = seam.probe
    if node is None:
        return None
    if kind == "param":
        args = node.args
        return name in [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    if kind == "method":
        return _definition(node, [name]) is not None
    if kind == "decorated":
        return any(name in ast.unparse(d) for d in getattr(node, "decorator_list", []))
    if kind == "default":
        return _flag_default(node, name)
    raise ValueError(f"unknown probe kind {kind!r}")


def megatron_root() -> Path | None:
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).resolve().parent.parent.parent


def differing(root: Path | None = None) -> list[tuple[Seam, object]]:
    """The seams whose probe answers otherwise than on 0.19.2, with the answer."""
    root = root or megatron_root()
    if root is None:
        return []
    result = []
    for seam in SEAMS:
        answer = probe(seam, root)
        if answer != seam.reference:
            result.append((seam, answer))
    return result


def report(found) -> list[str]:
    """``describe``'s "Megatron releases" section for the megatron-core ``found``."""
    lines = [f"Megatron releases: seams that differ in {found} from {REFERENCE}"]
    changed = differing()
    if not changed:
        lines.append(f"    none ({len(SEAMS)} seams checked)")
    for seam, answer in changed:
        what = "missing" if answer is None else seam.change
        lines.append(f"    {seam.target} [{seam.used_by}]: {what} -> {seam.handling}")
    return lines
