"""What every bench/ script records with its figures: the machine, and the JSON file."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform as py_platform
import sys
from pathlib import Path

import torch


def machine() -> dict:
    """The machine and software a result was measured on."""
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        megatron_version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        megatron_version = None
    return {
        "processor": py_platform.processor(),
        "machine": py_platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": py_platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": megatron_version,
    }


def write(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def report(result: dict, text: str, json_path: str | Path, quick: bool = False) -> dict:
    """Print a bench's table and write its JSON (a ``--quick`` smoke run to ``<name>-quick.json``, so
    it never overwrites the recorded figures)."""
    print()
    print(text)
    path = Path(json_path)
    if quick:
        path = path.with_name(f"{path.stem}-quick{path.suffix}")
    write(result, path)
    return result


def target_lines(targets: list, value_format: str = ".3f") -> list[str]:
    """One line per target: whether every place it applies met it, then each value (NOT where missed)."""
    grouped: dict[str, list] = {}
    for t in targets:
        grouped.setdefault(t["target"], []).append(t)
    lines = []
    for target, checks in grouped.items():
        verdict = "all met" if all(t["met"] for t in checks) else f"{sum(not t['met'] for t in checks)} NOT met"
        lines.append(f"  {target} ({verdict}): " + "; ".join(
            f"{t['where']} {format(t['value'], value_format)}{'' if t['met'] else ' NOT'}" for t in checks))
    return lines


def machine_line(result: dict) -> str:
    """The machine, the load around the run and the run's wall time, as the benches print them."""
    m = result["machine"]
    load = m["load_average_1min_before_after"]
    return (f"Machine: {m['cpu_model']} ({m['cpu_count']} cores), torch {m['torch']}, load average "
            f"{load[0]:.1f} before / {load[1]:.1f} after; {result['wall_s']:.0f} s.")


def rebind_c10d(names, wrap) -> list:
    """Put ``wrap(name, fn)`` in place of each named torch.distributed function in every module that holds
    it by name (``torch.distributed.X``, c10d's own globals — P2POp compares ``op is isend`` against them —
    and aliases such as megatron's ``dist_reduce_scatter_func``); returns what ``restore`` puts back."""
    from torch.distributed import distributed_c10d as c10d

    originals = {name: getattr(c10d, name) for name in names if hasattr(c10d, name)}
    wrappers = {id(fn): wrap(name, fn) for name, fn in originals.items()}
    installed = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            wrapper = wrappers.get(id(value)) if callable(value) else None
            if wrapper is not None and any(value is fn for fn in originals.values()):
                namespace[attr] = wrapper
                installed.append((namespace, attr, value))
    return installed


def restore(installed: list) -> None:
    for namespace, attr, value in reversed(installed):
        namespace[attr] = value
