"""Level-0 overhead on CPU: a megatron-core GPT training step under the adaptor's full level 0, against the
same step under only the patches megatron needs to run on this machine at all (``MINIMUM_TARGETS``).

Run from the repository root (docs/features/level0-compat.md says what is compared, how, and why)::

    python bench/level0_overhead.py                 # 20 interleaved rounds of 5 timed steps
    python bench/level0_overhead.py --quick         # smoke run (4 rounds of 3)
    python bench/level0_overhead.py --find-minimum  # re-derive MINIMUM_TARGETS

``main(argv)`` returns the result (the JSON it writes); never call it in a process that has imported
``hyper_adaptor.megatron_adaptor``: level 0 is applied there for good, so there is no minimum to compare.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/level0_overhead.py` puts bench/ first, not the root
    sys.path.insert(0, str(REPO_ROOT))

from bench import _gpt_step as gpt_step  # noqa: E402
from hyper_adaptor import platform as ha_platform  # noqa: E402
from hyper_adaptor.patch_manager import Patch, PatchManager  # noqa: E402
from hyper_adaptor.patches.compat import imports as compat_imports  # noqa: E402
from hyper_adaptor.testing.measure import add_preset_options, machine, preset, quick_json, write  # noqa: E402

TARGET_RATIO = 1.03
DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "level0_overhead.json"

# Found by `python bench/level0_overhead.py --find-minimum` on 2026-11-25 (megatron-core 0.19.2,
# torch 2.13.0+cpu, Python 3.11.7): 9 of 72 level-0 patches. Each is a target without which the
# step above does not run on CPU; the comment is the error seen without it.
MINIMUM_TARGETS: tuple[str, ...] = (
    "torch.cuda.current_device",  # AssertionError: Torch not compiled with CUDA enabled (param_and_grad_buffer)
    "torch.cuda.current_stream",  # same assertion (param_and_grad_buffer, grad sync)
    "torch.cuda.get_rng_state",  # same assertion (tensor_parallel/random.py)
    "torch.empty",  # RuntimeError: Cannot access accelerator device when none is available (utils.py)
    "torch.zeros",  # same (param_and_grad_buffer)
    "torch.tensor",  # AssertionError: Torch not compiled with CUDA enabled (optimizer.py)
    "torch.Tensor.type",  # AssertionError (clip_grads.py:174): the type-name view the wrap below switches on
    "megatron.core.tensor_parallel.random._set_cuda_rng_state",  # each step queues 16 never-run lazy calls
    "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",  # AssertionError (clip_grads.py:174)
)
# Fingerprint of the level-0 target list the minimum was derived from; when level 0 changes the
# run still measures (new patches count as overhead) but says that the minimum should be re-found.
MINIMUM_FROM_LEVEL0 = "402ee25bc463f1c6"

DEFAULTS = {"steps": 5, "rounds": 20, "warmup": 3}
QUICK = {"steps": 3, "rounds": 4, "warmup": 1}


# --- set-up ------------------------------------------------------------------------------------
def _bootstrap() -> None:
    """What Adaptor.bootstrap does before it patches: the import shims and the device choice."""
    if "hyper_adaptor.megatron_adaptor" in sys.modules:
        raise RuntimeError(
            "hyper_adaptor.megatron_adaptor is imported in this process, so level 0 is applied for "
            "good and there is no minimum to compare with; run the benchmark in a fresh process"
        )
    compat_imports.install()
    ha_platform.select_device_type("cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def level0_patches() -> list[Patch]:
    """The full level-0 list, exactly as the adaptor builds it (Compat.patches)."""
    from hyper_adaptor import features

    return list(features.get("compat").patches(None))


def level0_fingerprint(patches: list[Patch]) -> str:
    text = "\n".join(f"{p.target} {p.kind}" for p in patches)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _manager(patches: list[Patch]) -> PatchManager:
    manager = PatchManager()
    manager.register_all(patches)
    return manager


class Config:
    """One patch set, applied for the duration of a with-block (the RNG module's warning filter is one
    of level 0's patches like any other)."""

    def __init__(self, name: str, patches: list[Patch]):
        self.name, self.patches = name, patches
        self.manager = _manager(patches)

    def __enter__(self):
        self.manager.apply()
        return self

    def __exit__(self, *exc):
        self.manager.undo()
        return False


# --- minimum search ----------------------------------------------------------------------------
def _queued_device_calls() -> int:
    """Calls a CPU-only torch has deferred "until CUDA initialises" — i.e. forever."""
    return len(getattr(torch.cuda, "_queued_calls", ()))


def _runs(config: Config, steps: int = 3) -> str | None:
    """None when build + ``steps`` steps run under ``config``; else why not.

    Running means: no exception, a finite loss, and no per-step growth of torch.cuda's deferred-call
    queue (a call megatron makes that is queued, with a stack trace, and never executed: the step
    silently skips that work and its memory grows without bound, so it could not train for long).
    """
    model = optimizer = None
    try:
        with config:
            gpt_step.init_model_parallel()
            _, model, optimizer = gpt_step.build_training()
            batches = gpt_step.make_batches()
            for step in range(steps):
                queued = _queued_device_calls()
                loss = gpt_step.train_step(model, optimizer, batches)
                if not math.isfinite(loss):
                    return f"loss is {loss}"
                grown = _queued_device_calls() - queued
                if step > 0 and grown > 0:
                    return (f"each step queues {grown} torch.cuda calls that a CPU build never runs "
                            "(via torch.cuda._lazy_call; unbounded memory growth)")
        return None
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        where = next((f for f in reversed(frames) if "megatron" in f.filename), frames[-1] if frames else None)
        at = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
        message = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {message}{at}"[:240]
    finally:
        del model, optimizer
        gc.collect()


def find_minimum(verbose: bool = True) -> dict:
    full = level0_patches()
    say = print if verbose else (lambda *a, **k: None)
    gpt_step.init_distributed()
    reason = _runs(Config("level0", full))
    if reason is not None:
        raise RuntimeError(f"the step does not run even under the full level 0: {reason}")
    empty_reason = _runs(Config("none", []))
    say(f"without any level-0 patch: {empty_reason or 'runs'}")
    kept, needed_because = list(full), {}
    for patch in full:
        candidate = [p for p in kept if p is not patch]
        reason = _runs(Config("candidate", candidate))
        if reason is None:
            kept = candidate
            say(f"  drop  {patch.target}")
        else:
            needed_because[patch.target] = reason
            say(f"  KEEP  {patch.target}: {reason}")
    targets = [p.target for p in kept]
    fresh = _fresh_check(targets)
    if fresh is not None:
        raise RuntimeError(f"the minimum found in-process does not run in a fresh process: {fresh}")
    say("verified in a fresh process: the minimum builds and steps")
    return {
        "date": datetime.date.today().isoformat(),
        "targets": targets,
        "reasons": needed_because,
        "level0_fingerprint": level0_fingerprint(full),
        "level0_count": len(full),
        "without_any_patch": empty_reason,
    }


def _fresh_check(targets: list[str]) -> str | None:
    """Run ``--check-set`` in a new interpreter; None when the set runs there, else why not."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--check-set", json.dumps(targets)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(REPO_ROOT))
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith(("RUNS", "FAILS"))]
    if proc.returncode == 0 and verdicts and verdicts[-1] == "RUNS":
        return None
    if verdicts:
        return verdicts[-1]
    return f"exit code {proc.returncode}: {proc.stderr.strip()[-400:]}"


def _check_set(targets: list[str]) -> int:
    """Fresh-process check: nothing but ``targets`` is applied, from before model-parallel init."""
    _bootstrap()
    wanted = set(targets)
    patches = [p for p in level0_patches() if p.target in wanted]
    gpt_step.init_distributed()
    reason = _runs(Config("check", patches))
    print("RUNS" if reason is None else f"FAILS {reason}", flush=True)
    return 0


# --- measurement -------------------------------------------------------------------------------
def _timed_segment(config: Config, model, optimizer, batches, steps: int) -> list[float]:
    times = []
    gc.collect()
    with config:
        gpt_step.train_step(model, optimizer, batches)  # first step after a switch: not timed
        for _ in range(steps):
            start = time.perf_counter()
            gpt_step.train_step(model, optimizer, batches)
            times.append(time.perf_counter() - start)
    return times


def measure(steps: int, rounds: int, warmup: int) -> dict:
    full_patches = level0_patches()
    fingerprint = level0_fingerprint(full_patches)
    known = {p.target for p in full_patches}
    stale = [t for t in MINIMUM_TARGETS if t not in known]
    if stale:
        raise RuntimeError(f"MINIMUM_TARGETS names patches level 0 no longer has: {stale}; "
                           "re-run with --find-minimum")
    minimum_patches = [p for p in full_patches if p.target in set(MINIMUM_TARGETS)]
    configs = {
        "minimum": Config("minimum", minimum_patches),
        "level0": Config("level0", full_patches),
    }

    load_before = os.getloadavg()
    created_group = gpt_step.init_distributed()
    # Built once under the full set and shared (see the module docstring): identical tensors, so
    # only the patches active during the step differ.
    with configs["level0"]:
        gpt_step.init_model_parallel()
        _, model, optimizer = gpt_step.build_training()
    batches = gpt_step.make_batches()

    times = {name: [] for name in configs}
    per_round = []
    try:
        for _ in range(warmup):
            for config in configs.values():
                _timed_segment(config, model, optimizer, batches, 1)
        for r in range(rounds):
            order = ["minimum", "level0"] if r % 2 == 0 else ["level0", "minimum"]
            medians = {}
            for name in order:
                segment = _timed_segment(configs[name], model, optimizer, batches, steps)
                times[name].extend(segment)
                medians[name] = statistics.median(segment) * 1000.0
            per_round.append({"order": order, "median_ms": medians,
                              "ratio": medians["level0"] / medians["minimum"]})
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if created_group:
            import torch.distributed as dist

            dist.destroy_process_group()

    results = {name: dict(gpt_step.summary(times[name]), patches=len(configs[name].patches)) for name in configs}
    ratio = results["level0"]["median_ms"] / results["minimum"]["median_ms"]
    return {
        "benchmark": "level0_overhead",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {
            "steps_per_round": steps, "rounds": rounds, "warmup_steps_per_config": warmup,
            "model": {"hidden": gpt_step.HIDDEN, "heads": gpt_step.HEADS, "ffn": gpt_step.FFN,
                      "layers": gpt_step.LAYERS, "seq": gpt_step.SEQ, "micro_batch": gpt_step.MICRO_BATCH,
                      "num_microbatches": gpt_step.NUM_MICRO, "vocab": gpt_step.VOCAB,
                      "spec": "local", "dtype": "float32"},
            "parallel": {"world": 1, "backend": "gloo", "tp": 1, "pp": 1},
            "optimizer": {"type": "adam", "clip_grad": 1.0, "ddp": True},
        },
        "load_average_1_5_15": {"before": list(load_before), "after": list(os.getloadavg())},
        "configs": results,
        "ratio": ratio,
        "ratio_per_round_median": statistics.median(r["ratio"] for r in per_round),
        "per_round": per_round,
        "target": TARGET_RATIO,
        "met": ratio <= TARGET_RATIO,
        "minimum": {
            "targets": list(MINIMUM_TARGETS),
            "found_for_level0": MINIMUM_FROM_LEVEL0,
            "level0_now": fingerprint,
            "current": MINIMUM_FROM_LEVEL0 == fingerprint,
        },
        "level0_targets": [p.target for p in full_patches],
    }


def format_table(result: dict) -> str:
    rows = [("config", "patches", "median ms/step", "p10 ms", "p90 ms", "ratio vs minimum")]
    base = result["configs"]["minimum"]["median_ms"]
    for name in ("minimum", "level0"):
        c = result["configs"][name]
        rows.append((name, str(c["patches"]), f"{c['median_ms']:.2f}", f"{c['p10_ms']:.2f}",
                     f"{c['p90_ms']:.2f}", f"{c['median_ms'] / base:.4f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    verdict = "met" if result["met"] else "NOT met"
    lines.append("")
    lines.append(f"ratio level0/minimum = {result['ratio']:.4f} (target <= {result['target']}: {verdict}); "
                 f"median of per-round ratios {result['ratio_per_round_median']:.4f}")
    if not result["minimum"]["current"]:
        lines.append("note: level 0 changed since MINIMUM_TARGETS was found; re-run with --find-minimum")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset_options(parser, DEFAULTS, QUICK)
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the JSON result")
    parser.add_argument("--find-minimum", action="store_true",
                        help="re-derive the minimum patch set (prints it; paste into MINIMUM_TARGETS)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's own choice, recorded in the JSON)")
    parser.add_argument("--check-set", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.check_set is not None:
        gpt_step.sink_fork_warning()
        _check_set(json.loads(args.check_set))
        return {}

    _bootstrap()
    gpt_step.sink_fork_warning()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.find_minimum:
        found = find_minimum()
        print("\nMINIMUM_TARGETS = (")
        for target in found["targets"]:
            print(f"    {target!r},  # {found['reasons'][target]}")
        print(")")
        print(f'MINIMUM_FROM_LEVEL0 = "{found["level0_fingerprint"]}"  # {found["date"]}, '
              f'{len(found["targets"])} of {found["level0_count"]} level-0 patches')
        return found

    result = measure(**preset(args, DEFAULTS, QUICK))
    result["settings"]["quick"] = args.quick
    print(format_table(result))
    write(result, quick_json(args.json, args.quick))
    return result


if __name__ == "__main__":
    main()
