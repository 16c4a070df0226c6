"""The layers of hyper_adaptor (docs/design.md), read from the source: every import statement of every
module, the ones inside functions too, must point down or sideways, never up.

    entry points (megatron_adaptor, cli, __main__, the package itself, testing)
      -> features -> patches (with patch_manager, megatron_version) -> engines (parallel, memory, ops)
      -> notice -> platform

and a module whose name starts with ``_`` is private to its package: only modules of that package import it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hyper_adaptor"
ENGINES = ("parallel", "memory", "ops", "optim")
# rank of each layer: a module may import modules of its own rank or lower (platform: only platform)
RANKS = {"platform": 0, "notice": 1, "engines": 2, "patches": 3, "features": 4, "entry": 5}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, module-level or lazy; ``from pkg import name`` counts as
    ``pkg.name`` where that is a module, else as ``pkg``."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module_name(path).split(".")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if _is_package(path) else here[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                full = f"{module}.{alias.name}"
                found.append((node.lineno, full if _is_module(full) else module))
    return found


def layer(module: str) -> str | None:
    """The layer of a hyper_adaptor module (None: not hyper_adaptor's)."""
    parts = module.split(".")
    if parts[0] != "hyper_adaptor":
        return None
    top = parts[1] if len(parts) > 1 else ""
    if top in ENGINES:
        return "engines"
    if top in ("platform", "notice", "features", "patches"):
        return top
    if top in ("patch_manager", "megatron_version"):
        return "patches"  # the patching toolkit: nothing below the patches patches anything
    return "entry"  # the package itself, __main__, cli, megatron_adaptor, testing


def upward(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported``, or None."""
    if imported.split(".")[0] == "megatron":
        if layer(importer) in ("platform", "notice", "engines"):
            return "engines and the platform never import megatron"
        return None
    own, other = layer(importer), layer(imported)
    if own is None or other is None:
        return None
    # the dry-run's calibration is a micro-benchmark of the machine: it starts its worlds as the benches do
    if imported.startswith("hyper_adaptor.testing") and not importer.startswith("hyper_adaptor.testing") \
            and importer != "hyper_adaptor.dryrun.calibrate_worlds":
        return "hyper_adaptor.testing is for tests and benches; the library never imports it"
    if own == "platform" and other != "platform":
        return "platform imports nothing of hyper_adaptor but itself"
    if RANKS[other] > RANKS[own]:
        return f"{own} may not import {other} (an arrow upward)"
    return None


def private(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported`` as a private module of another package, or None."""
    parts = imported.split(".")
    if parts[0] != "hyper_adaptor":
        return None
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            owner = ".".join(parts[:i])
            if importer != owner and not importer.startswith(owner + "."):
                return f"{'.'.join(parts[:i + 1])} is private to {owner}: import its public names from {owner}"
            return None
    return None


def private_names(path: pathlib.Path) -> list[str]:
    """``from <module of another package> import _name`` in ``path``: a private name reached from outside."""
    importer = _module_name(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("hyper_adaptor"):
            continue
        package = ROOT.joinpath(*node.module.split("."), "__init__.py").exists()
        owner = node.module if package else node.module.rpartition(".")[0]
        if importer == owner or importer.startswith(owner + "."):
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__") \
                    and not _is_module(f"{node.module}.{alias.name}"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {node.module}.{alias.name}, "
                             f"private to {owner}")
    return found


def _sources(*folders: str):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def _violations(rule, *folders: str) -> list[str]:
    found = []
    for path in _sources(*folders):
        importer = _module_name(path)
        for line, imported in imports(path):
            why = rule(importer, imported)
            if why:
                found.append(f"{path.relative_to(ROOT)}:{line}: imports {imported}: {why}")
    return found


def test_no_import_points_upward():
    assert _violations(upward, "hyper_adaptor") == []


def test_private_modules_are_imported_only_inside_their_package():
    assert _violations(private, "hyper_adaptor", "bench") == []


def test_private_names_are_not_imported_from_another_package():
    assert [v for path in _sources("hyper_adaptor", "bench") for v in private_names(path)] == []


@pytest.mark.parametrize("importer, imported, why", [
    ("hyper_adaptor.patches.compat.arguments", "hyper_adaptor.features", "an arrow upward"),
    ("hyper_adaptor.parallel.hsdp.api", "hyper_adaptor.patch_manager", "an arrow upward"),
    ("hyper_adaptor.memory.api", "megatron.core", "never import megatron"),
    ("hyper_adaptor.platform", "hyper_adaptor.notice", "platform imports nothing"),
    ("hyper_adaptor.features.hsdp", "hyper_adaptor.megatron_adaptor", "an arrow upward"),
    ("hyper_adaptor.ops.backend", "hyper_adaptor.testing", "the library never imports it"),
])
def test_the_rules_catch_an_upward_arrow(importer, imported, why):
    assert why in upward(importer, imported)


def test_the_rules_allow_downward_and_sideways_arrows():
    assert upward("hyper_adaptor.features.hsdp", "hyper_adaptor.parallel.hsdp") is None
    assert upward("hyper_adaptor.parallel.context", "hyper_adaptor.ops.attention") is None
    assert upward("hyper_adaptor.patches.fused.rope", "megatron.core") is None
    assert upward("hyper_adaptor.megatron_adaptor", "hyper_adaptor.features") is None


def test_the_private_rule_and_the_import_reader(tmp_path):
    assert "private to hyper_adaptor.parallel.hsdp" in private("hyper_adaptor.patches.hsdp.patches",
                                                               "hyper_adaptor.parallel.hsdp._config")
    assert private("hyper_adaptor.parallel.hsdp.api", "hyper_adaptor.parallel.hsdp._config") is None
    assert private("bench.hsdp", "hyper_adaptor.parallel.hsdp") is None
    # a lazy import inside a function is read like a module-level one; relative imports are resolved
    found = dict((m, line) for line, m in imports(PACKAGE / "features" / "hsdp.py"))
    assert "hyper_adaptor.patches.hsdp.patches" in found  # `from hyper_adaptor.patches.hsdp import patches`
    relative = imports(PACKAGE / "parallel" / "pipeline" / "schedules.py")
    assert any(m == "hyper_adaptor.parallel.pipeline.actions" for _, m in relative), relative
