"""The private torch API table (hyper_adaptor/platform/torch_private.py): every row resolves in the running
torch, and the package's source uses no private torch name the table does not list.

The source scan has two halves. Paths rooted in torch (``torch._C...``, ``from torch.utils._pytree import``,
an alias such as ``import torch.utils._device as ctx`` then ``ctx._x``, ``aten = torch.ops.aten`` then
``aten._x``, a string ``"torch._dynamo.exc"``) must each be covered by a row. Private attributes reached
through an object (``dtensor._local_tensor``, ``mesh._flatten()``, ``getattr(t, "_base")``) cannot be
traced to torch by reading the source, so every such name that this package does not define itself
must be either the last part of a row or named in NOT_TORCH below with its owner: a new one fails
until someone decides which it is.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
import torch

import hyper_adaptor
from hyper_adaptor.platform import torch_private

PACKAGE = Path(hyper_adaptor.__file__).parent

# Private attributes this package reaches on objects that are not torch's, and whose they are.
NOT_TORCH = {
    "_GLOBAL_ARGS": "megatron.training.global_vars",
    "_actions": "argparse.ArgumentParser",
    "_build_default_pg_collection": "megatron.core.pipeline_parallel.schedules (patched seam)",
    "_build_model_and_main_param_groups": "megatron.core.optimizer (patched seam)",
    "_eopt_init_state_fn": "megatron.core.optimizer (Muon seam)",
    "_muon_config_to_kwargs": "megatron.core.optimizer (Muon seam)",
    "_grad_accum_fusion_available": "megatron.core.tensor_parallel.layers",
    "_initialize_distributed": "megatron.training.initialize (patched seam)",
    "_set_cuda_rng_state": "megatron.core.tensor_parallel.random (patched seam)",
    "_warmup_jit_function": "megatron.training.initialize (patched seam)",
    "_shard_divisor": "megatron.core.optimizer (Muon seam)",
    "_ExperimentalConfig": "torch_npu.profiler (NPU profiling); torch's own is listed as torch._C._profiler",
    "_option_string_actions": "argparse.ArgumentParser",
    "_getframe": "sys (the triton stand-in reads its importer's frame)",
    "_run_exitfuncs": "atexit (the tests' launcher ends a forked rank as an interpreter ends)",
    "_exit": "os",
}

_PRIVATE = re.compile(r"_(?!_)\w*")
_TORCH_STRING = re.compile(r"torch(\.\w+)+")
_ATTR_FUNCS = {"getattr", "hasattr", "setattr", "delattr"}


def _is_private(part: str) -> bool:
    return bool(_PRIVATE.fullmatch(part))


@functools.lru_cache(maxsize=1)
def _sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _chain(node: ast.AST) -> tuple[str, list[str]] | None:
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def torch_paths(tree: ast.Module) -> list[tuple[str, int]]:
    """Every dotted torch path ``tree`` names: imports, attribute chains on torch-bound names, strings."""
    aliases: dict[str, str] = {}
    uses: list[tuple[str, int]] = []
    nodes = list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
                    uses.append((a.name, node.lineno))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == "torch":
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    uses.append((f"{node.module}.{a.name}", node.lineno))
    for _ in range(2):  # `aten = torch.ops.aten`, and an alias of that alias
        for node in nodes:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                chain = _chain(node.value)
                if chain and chain[0] in aliases:
                    aliases[node.targets[0].id] = ".".join([aliases[chain[0]], *chain[1]])
    inner = {id(n.value) for n in nodes if isinstance(n, ast.Attribute)}
    for node in nodes:
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            if chain and chain[0] in aliases:
                uses.append((".".join([aliases[chain[0]], *chain[1]]), node.lineno))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _TORCH_STRING.fullmatch(node.value):
            uses.append((node.value, node.lineno))
    return uses


def covered(use: str, listed: list[str]) -> bool:
    """Whether a row covers ``use``: the row is a prefix of it that reaches its last private part (a use
    may go on past it, ``..._execution_engine.queue_callback``), or ``use`` imports the private module
    or class a row lies under."""
    parts = use.split(".")
    last_private = max(i for i, p in enumerate(parts) if _is_private(p))
    for name in listed:
        row = name.split(".")
        if len(row) > last_private and parts[: len(row)] == row:
            return True
        if len(row) > len(parts) and row[: len(parts)] == parts and _is_private(parts[-1]):
            return True
    return False


def unlisted_torch_paths(sources: dict[str, ast.Module], listed: list[str]) -> list[str]:
    out = []
    for rel, tree in sources.items():
        for use, line in torch_paths(tree):
            if any(_is_private(p) for p in use.split(".")) and not covered(use, listed):
                out.append(f"{rel}:{line}: {use}")
    return out


def _defined_here(sources: dict[str, ast.Module]) -> set[str]:
    """Private names this package gives a meaning to itself (so ``x._name`` may well be its own)."""
    names = {Path(rel).stem for rel in sources}
    for tree in sources.values():
        read = {id(node.args[1]) for node in ast.walk(tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name) and node.func.id in _ATTR_FUNCS - {"setattr"}
                and len(node.args) > 1}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                names.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names.add(node.args[1].value)
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_private(node.value)
                  and id(node) not in read):
                names.add(node.value)  # __slots__, registry keys; not the name a getattr reads
    return names


def private_attributes(tree: ast.Module) -> list[tuple[str, int]]:
    """``x._name`` and ``getattr(x, "_name")`` in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            out.append((node.attr, node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTR_FUNCS
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _is_private(node.args[1].value)):
            out.append((node.args[1].value, node.lineno))
    return out


@functools.lru_cache(maxsize=1)
def _package_defines() -> frozenset[str]:
    return frozenset(_defined_here(_sources()))


def unclassified_attributes(sources: dict[str, ast.Module], listed: list[str]) -> list[str]:
    torch_parts = {p for name in listed for p in name.split(".") if _is_private(p)}
    extra = {rel: tree for rel, tree in sources.items() if _sources().get(rel) is not tree}
    own = (_package_defines() | _defined_here(extra)) - torch_parts - set(NOT_TORCH)
    out = []
    for rel, tree in sources.items():
        for name, line in private_attributes(tree):
            if name not in own and name not in torch_parts and name not in NOT_TORCH:
                out.append(f"{rel}:{line}: .{name}")
    return out


LISTED = [api.name for api in torch_private.APIS]


def test_every_listed_private_api_exists_in_this_torch():
    assert torch_private.missing() == [], f"torch {torch.__version__}"


def test_rows_are_private_and_name_the_files_that_use_them():
    for api in torch_private.APIS:
        assert any(_is_private(p) for p in api.name.split(".")), api.name
        for rel in api.used_in:
            assert (PACKAGE / rel).is_file(), f"{api.name}: {rel}"
        assert api.checked_on and api.why


def test_source_uses_no_unlisted_private_torch_path():
    found = unlisted_torch_paths(_sources(), LISTED)
    assert not found, f"private torch names used but not listed in hyper_adaptor/platform/torch_private.py: {found}"


def test_source_reaches_no_unclassified_private_attribute():
    found = unclassified_attributes(_sources(), LISTED)
    assert not found, ("private attributes of objects this package does not define: list torch's in "
                       f"hyper_adaptor/platform/torch_private.py, name any other owner in NOT_TORCH: {found}")


def test_every_row_is_still_used():
    """A row whose use is gone is stale: the scan would otherwise keep excusing it."""
    sources = _sources()
    paths = {use for tree in sources.values() for use, _ in torch_paths(tree)}
    attrs = {name for tree in sources.values() for name, _ in private_attributes(tree)}
    for name in LISTED:
        last = [p for p in name.split(".") if _is_private(p)][-1]
        assert any(covered(use, [name]) for use in paths if any(_is_private(p) for p in use.split("."))) \
            or last in attrs, name


@pytest.mark.parametrize("snippet, expect", [
    ("import torch\nx = torch._C._get_tracing_state()\n", "torch._C._get_tracing_state"),
    ("from torch.distributed._functional_collectives import all_reduce\n",
     "torch.distributed._functional_collectives.all_reduce"),
    ("from torch.distributed.tensor import _ops\n", "torch.distributed.tensor._ops"),
    ("import torch.distributed as dist\ndist.distributed_c10d._get_default_group()\n",
     "torch.distributed.distributed_c10d._get_default_group"),
    ("import torch\naten = torch.ops.aten\naten._fused_thing(1)\n", "torch.ops.aten._fused_thing"),
    ("import torch.utils._device as ctx\nctx._other()\n", "torch.utils._device._other"),
    ("NAMES = ('torch._higher_order_ops.x',)\n", "torch._higher_order_ops.x"),
    ("import torch\nt = torch._C.TensorBase.other\n", "torch._C.TensorBase.other"),
])
def test_scan_catches_a_new_private_torch_path(snippet, expect):
    sources = {**_sources(), "new.py": ast.parse(snippet)}
    found = unlisted_torch_paths(sources, LISTED)
    assert [f for f in found if f.startswith("new.py:")] and expect in " ".join(found)


@pytest.mark.parametrize("snippet, expect", [
    ("def f(dt):\n    return dt._local_shard\n", "._local_shard"),
    ("def f(pg):\n    return getattr(pg, '_group_name_x')\n", "._group_name_x"),
    ("def f(mesh):\n    return mesh['dp']._dim_group_infos\n", "._dim_group_infos"),
])
def test_scan_catches_a_new_private_attribute(snippet, expect):
    sources = {**_sources(), "new.py": ast.parse(snippet)}
    assert any(f.startswith("new.py:") and f.endswith(expect) for f in unclassified_attributes(sources, LISTED))


def test_scan_passes_listed_uses_and_this_packages_own_names():
    snippet = ("import torch\nfrom torch.utils._pytree import tree_map\n"
               "class A:\n    def __init__(self):\n        self._mine = 1\n"
               "def f(a, t):\n    return a._mine, t._local_tensor, torch.autograd.Variable._execution_engine.x\n")
    sources = {**_sources(), "new.py": ast.parse(snippet)}
    assert not [f for f in unlisted_torch_paths(sources, LISTED) if f.startswith("new.py:")]
    assert not [f for f in unclassified_attributes(sources, LISTED) if f.startswith("new.py:")]


def test_setup_py_declares_the_checked_torch_range():
    """setup.py's torch range is what was checked: its floor the oldest release in CHECKED, its ceiling
    the first minor release above the newest."""
    from packaging.version import Version

    text = (PACKAGE.parent / "setup.py").read_text()
    floor, ceiling = re.search(r'"torch>=([\d.]+),<([\d.]+)"', text).groups()
    checked = sorted(Version(v) for v in torch_private.CHECKED)
    assert Version(floor) == Version(f"{checked[0].major}.{checked[0].minor}")
    assert Version(ceiling) == Version(f"{checked[-1].major}.{checked[-1].minor + 1}")
