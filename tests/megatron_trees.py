"""megatron-core releases as a Megatron-LM checkout user has them: a directory on PYTHONPATH holding
``megatron/`` and no pip metadata. Made from the release wheels (``make setup`` downloads them into
``<venv>/megatron-releases``; fetched here with pip if missing), the ``*.dist-info`` left out."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

RELEASES = Path(sys.prefix) / "megatron-releases"


def wheel(version: str) -> Path:
    found = sorted(RELEASES.glob(f"megatron_core-{version}-*.whl"))
    if not found:
        RELEASES.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--ignore-requires-python",
                        f"megatron-core=={version}", "-d", str(RELEASES)], check=True, timeout=600)
        found = sorted(RELEASES.glob(f"megatron_core-{version}-*.whl"))
    assert found, f"no megatron-core {version} wheel in {RELEASES}"
    return found[-1]


def source_tree(version: str, dest: Path) -> Path:
    """``dest`` with megatron-core ``version``'s ``megatron/`` package and no pip metadata."""
    with zipfile.ZipFile(wheel(version)) as archive:
        members = [m for m in archive.namelist() if m.startswith("megatron/")]
        archive.extractall(dest, members)
    assert not list(dest.glob("*.dist-info"))
    return dest


def copy_tree(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


# megatron's own Muon comes from emerging-optimizers (and its one dependency besides torch, absl-py),
# which declares Python >= 3.12: the tests put the unpacked wheels on PYTHONPATH of the runs that compare
# against it, and the rest of the suite runs without it (hyper_adaptor's Muon serves --optimizer muon).
EMERGING = Path(sys.prefix) / "emerging-optimizers"
EMERGING_PINS = ("emerging-optimizers==0.3.0", "absl-py==2.5.1")


def emerging_optimizers_tree(dest: Path) -> Path:
    """``dest`` holding the ``emerging_optimizers`` and ``absl`` packages (no pip metadata)."""
    for pin in EMERGING_PINS:
        stem = pin.split("==")[0].replace("-", "_")
        if not sorted(EMERGING.glob(f"{stem}-*.whl")):
            EMERGING.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--ignore-requires-python",
                            pin, "-d", str(EMERGING)], check=True, timeout=600)
        found = sorted(EMERGING.glob(f"{stem}-*.whl"))
        assert found, f"no {pin} wheel in {EMERGING}"
        with zipfile.ZipFile(found[-1]) as archive:
            archive.extractall(dest, [m for m in archive.namelist() if ".dist-info/" not in m])
    return dest


# A snapshot of Megatron-LM main (megatron-core 0.20.0, the preview release): `megatron/`, the root
# scripts and a COMMIT file, kept beside the checkout (<repo>/../shared/megatron-lm-main) or named by
# HYPER_ADAPTOR_MEGATRON_MAIN. It is shared and may be read-only: tests copy it before building anything.
MAIN_ENV = "HYPER_ADAPTOR_MEGATRON_MAIN"
MAIN_DEFAULT = Path(__file__).resolve().parents[1].parent / "shared" / "megatron-lm-main"
MAIN_VERSION = "0.20.0"


def main_snapshot() -> Path | None:
    for path in ([Path(os.environ[MAIN_ENV])] if os.environ.get(MAIN_ENV) else []) + [MAIN_DEFAULT]:
        if (path / "megatron" / "core" / "package_info.py").is_file():
            return path
    return None


MAIN_SKIP = (f"no Megatron-LM main snapshot (a directory holding megatron/ and COMMIT) at ${MAIN_ENV} "
             f"({os.environ.get(MAIN_ENV) or 'unset'}) or {MAIN_DEFAULT}")


def main_commit() -> str:
    return (main_snapshot() / "COMMIT").read_text().split()[0]


def main_tree(dest: Path) -> Path:
    """A writable copy of the main snapshot at ``dest`` (the caller skips with MAIN_SKIP when absent)."""
    source = main_snapshot()
    assert source is not None, MAIN_SKIP
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "helpers_cpp*"),
                    copy_function=shutil.copyfile)
    for folder, _, _ in os.walk(dest):
        os.chmod(folder, 0o755)
    return dest
