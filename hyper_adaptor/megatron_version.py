"""Which megatron-core this process would import, and whether hyper_adaptor supports it.

Two ways people have megatron-core, both found here without importing it:

* the pip package (``pip install megatron-core``): its version is in the distribution's metadata;
* a Megatron-LM checkout on ``PYTHONPATH`` (or the working directory), the way MindSpeed's users work:
  no metadata at all, the version is the ``MAJOR``/``MINOR``/``PATCH``/``PRE_RELEASE`` constants of
  ``megatron/core/package_info.py``. That file is read, not imported: importing it runs ``git`` and
  importing ``megatron.core`` runs all of megatron-core.

When both exist the one Python would import wins: the metadata only counts if its files are the
``megatron/core`` that ``import megatron.core`` finds. The supported releases are those every patch
target is checked against (tests/unit/test_megatron_versions.py resolves every feature's patches in
each). A PREVIEW release is the next one as Megatron-LM's ``main`` branch has it: checked against one
named snapshot of ``main`` (``PREVIEW_SNAPSHOT``), accepted without the variable, with a notice that says
"preview" and names the commit of the checkout in use, since ``main`` moves under one version number.
``HYPER_ADAPTOR_ALLOW_MEGATRON_VERSION`` (the version found, or ``any``) lets a user try
another release at their own risk: a loud notice, and a patch target that does not exist there is
still an error naming the feature, the target and the version.

Stdlib only: imported before megatron and torch.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Megatron-LM branch core_r0.19.0 reports 0.19.1 in package_info.py; the wheels are 0.19.0 .. 0.19.2.
SUPPORTED = ("0.19.0", "0.19.1", "0.19.2")
# version -> where it comes from; the patch targets were checked on Megatron-LM main at PREVIEW_SNAPSHOT
PREVIEW = {"0.20.0": "Megatron-LM main"}
PREVIEW_SNAPSHOT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
ALLOW_ENV = "HYPER_ADAPTOR_ALLOW_MEGATRON_VERSION"
HELP = "see 'Supported Megatron versions' in hyper_adaptor's README.md"


class UnsupportedMegatronError(RuntimeError):
    """megatron-core is missing or a release hyper_adaptor's patches are not checked against."""


@dataclass(frozen=True)
class MegatronVersion:
    version: str
    source: str  # "pip metadata" or "source tree"
    location: str  # the megatron/core directory Python imports

    def __str__(self) -> str:
        return f"megatron-core {self.version} ({self.source} at {self.location})"


def _core_package_dir() -> Path | None:
    """The megatron/core directory ``import megatron.core`` would use (``megatron`` is a namespace
    package, so finding the submodule imports nothing that runs code)."""
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith("__init__.py"):
        return None
    return Path(spec.origin).resolve().parent


def _metadata_version(core_dir: Path) -> str | None:
    """The pip metadata's version, if that distribution's files are ``core_dir``."""
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        installed = Path(dist.locate_file("megatron/core/__init__.py")).resolve()
    except (OSError, TypeError):
        return None
    return dist.version if installed.parent == core_dir else None


def read_package_info(path: Path) -> str:
    """The version in a megatron ``package_info.py``, from its constants (the file is not run)."""
    values = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE") and isinstance(node.value, ast.Constant):
                values[name] = node.value.value
    if not {"MAJOR", "MINOR", "PATCH"} <= values.keys():
        raise UnsupportedMegatronError(f"{path} has no MAJOR / MINOR / PATCH constants: cannot tell the "
                                       f"megatron-core version ({HELP})")
    return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE') or ''}"


def detect() -> MegatronVersion | None:
    """The megatron-core Python would import here, or None when there is none."""
    core_dir = _core_package_dir()
    if core_dir is None:
        return None
    version = _metadata_version(core_dir)
    if version is not None:
        return MegatronVersion(version, "pip metadata", str(core_dir))
    info = core_dir / "package_info.py"
    if not info.is_file():
        raise UnsupportedMegatronError(f"megatron.core at {core_dir} has neither pip metadata nor "
                                       f"package_info.py: cannot tell its version ({HELP})")
    return MegatronVersion(read_package_info(info), "source tree", str(core_dir))


def check(found: MegatronVersion | None = None) -> tuple[MegatronVersion, str | None]:
    """The megatron-core to adapt, and a notice when it is an unlisted release allowed by the user.

    Raises UnsupportedMegatronError naming the version, where it was found and the supported range."""
    found = found if found is not None else detect()
    supported = ", ".join(SUPPORTED) + "".join(f" (and {v} from {where} as a preview)" for v, where in PREVIEW.items())
    if found is None:
        raise UnsupportedMegatronError(
            f"hyper_adaptor needs megatron-core ({supported}) and Python cannot import megatron.core: "
            f"pip install megatron-core, or put a Megatron-LM checkout on PYTHONPATH ({HELP})")
    if found.version in SUPPORTED:
        return found, None
    if found.version in PREVIEW:
        return found, (
            f"megatron-core {found.version} is a PREVIEW release ({PREVIEW[found.version]}, checkout commit "
            f"{checkout_commit(found)}; hyper_adaptor's patch targets were checked at {PREVIEW_SNAPSHOT[:12]}): "
            f"using {found}. Every patch target is resolved at start-up; {HELP}")
    allowed = os.environ.get(ALLOW_ENV, "")
    if allowed in (found.version, "any"):
        return found, (
            f"WARNING: {found} is not a release hyper_adaptor is checked against ({supported}); "
            f"running anyway because {ALLOW_ENV}={allowed}. Every patch target is still resolved "
            f"at start-up, but behaviour changes inside megatron are not caught")
    raise UnsupportedMegatronError(
        f"hyper_adaptor supports megatron-core {supported}; found {found}. To try it at your own "
        f"risk set {ALLOW_ENV}={found.version} ({HELP})")


def checkout_commit(found: MegatronVersion) -> str:
    """The commit of the Megatron-LM checkout holding ``found`` (``git rev-parse`` in it, else the first
    word of a ``COMMIT`` file beside ``megatron/``, as an exported snapshot has it), or ``unknown``."""
    root = Path(found.location).parent.parent
    try:
        result = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=False)
        # a checkout inside some other repository (a venv under a project) must not answer with that one's HEAD
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10, check=False)
        if result.returncode == 0 and top.returncode == 0 and Path(top.stdout.strip()).resolve() == root.resolve():
            return result.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        words = (root / "COMMIT").read_text(encoding="utf-8").split()
    except (OSError, UnicodeDecodeError):
        words = []
    return words[0][:12] if words else "unknown"
