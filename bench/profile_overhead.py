"""What ``--profile`` costs: a megatron-core GPT training step with profiling off, and inside the
profiler's window at each ``--profile-level`` (and with every option on), as ratios in one run.

Run from the repository root (docs/features/profiling.md says how it is measured)::

    python bench/profile_overhead.py            # 6 interleaved rounds of 4-step windows
    python bench/profile_overhead.py --quick    # smoke run (2 rounds of 2)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/profile_overhead.py` puts bench/ first, not the root
    sys.path.insert(0, str(REPO_ROOT))

import hyper_adaptor.megatron_adaptor  # noqa: E402,F401  (level 0, as in a real run)
from bench import _gpt_step as model_bench  # noqa: E402
from hyper_adaptor.patches.profiling import window as profile_window  # noqa: E402
from hyper_adaptor.testing.measure import add_preset_options, machine, preset, quick_json, write  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "profile_overhead.json"
DEFAULTS = {"steps": 4, "rounds": 6, "warmup": 1}
QUICK = {"steps": 2, "rounds": 2, "warmup": 1}
CONTENDERS = {
    "off": None,
    "level0": dict(level="level0"),
    "level1": dict(level="level1"),
    "level2": dict(level="level2"),
    "level2-all": dict(level="level2", with_stack=True, with_memory=True, record_shapes=True),
}


def _config(options: dict, steps: int, save_path: str) -> profile_window.WindowConfig:
    values = dict(start=1, end=1 + steps, ranks=None, level="level0", with_cpu=True, with_stack=False,
                  with_memory=False, record_shapes=False, save_path=save_path)
    values.update(options)
    return profile_window.WindowConfig(**values)


def _segment(options, steps, model, optimizer, batches, save_path) -> tuple[list[float], float, int]:
    """(recorded step times s, close time s, trace bytes) of one window; ``options`` None: no window."""
    gc.collect()
    if options is None:
        model_bench.train_step(model, optimizer, batches)  # as the windows' untimed warm-up step
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            model_bench.train_step(model, optimizer, batches)
            times.append(time.perf_counter() - start)
        return times, 0.0, 0
    shutil.rmtree(save_path, ignore_errors=True)
    profile_window.configure(_config(options, steps, save_path))
    active = profile_window.current()
    times, close = [], 0.0
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the per-window summary
            for i in range(steps + 1):
                outer = time.perf_counter()
                with active.step(i):
                    start = time.perf_counter()
                    model_bench.train_step(model, optimizer, batches)
                    body = time.perf_counter() - start
                if i:
                    times.append(body)
                if i == steps:  # the context's exit after the last step stopped, wrote and summarised
                    close = time.perf_counter() - outer - body
    finally:
        profile_window.configure(None)
    assert active.done, "the window did not close"
    size = sum(f.stat().st_size for f in Path(save_path).iterdir())
    return times, close, size


def measure(steps: int, rounds: int, warmup: int) -> dict:
    load_before = os.getloadavg()
    created_group = model_bench.init_distributed()
    model_bench.init_model_parallel()
    _, model, optimizer = model_bench.build_training()
    batches = model_bench.make_batches()
    scratch = tempfile.mkdtemp(prefix="profile_overhead_")
    names = list(CONTENDERS)
    times = {n: [] for n in names}
    closes = {n: [] for n in names}
    sizes = {n: [] for n in names}
    per_round = []
    try:
        for _ in range(warmup):
            for name in names:
                _segment(CONTENDERS[name], 1, model, optimizer, batches, os.path.join(scratch, name))
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            medians = {}
            for name in order:
                t, close, size = _segment(CONTENDERS[name], steps, model, optimizer, batches,
                                          os.path.join(scratch, name))
                times[name] += t
                closes[name].append(close)
                sizes[name].append(size)
                medians[name] = statistics.median(t) * 1e3
            per_round.append({"order": order, "median_ms": medians,
                              "ratio": {n: medians[n] / medians["off"] for n in names}})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if created_group:
            torch.distributed.destroy_process_group()

    base = statistics.median(times["off"])
    configs = {}
    for name in names:
        configs[name] = dict(model_bench.summary(times[name]), ratio=statistics.median(times[name]) / base,
                             ratio_per_round_median=statistics.median(r["ratio"][name] for r in per_round),
                             close_ms=statistics.median(closes[name]) * 1e3,
                             trace_mb=statistics.median(sizes[name]) / 2**20,
                             options=CONTENDERS[name])
    return {
        "benchmark": "profile_overhead",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "device": "cpu (torch.profiler, CPU activity)",
        "settings": {
            "recorded_steps_per_window": steps, "rounds": rounds, "warmup_windows": warmup,
            "model": {"hidden": model_bench.HIDDEN, "heads": model_bench.HEADS, "ffn": model_bench.FFN,
                      "layers": model_bench.LAYERS, "seq": model_bench.SEQ,
                      "micro_batch": model_bench.MICRO_BATCH, "num_microbatches": model_bench.NUM_MICRO,
                      "vocab": model_bench.VOCAB, "spec": "local", "dtype": "float32"},
            "parallel": {"world": 1, "backend": "gloo", "tp": 1, "pp": 1},
        },
        "load_average_1_5_15": {"before": list(load_before), "after": list(os.getloadavg())},
        "configs": configs,
        "per_round": per_round,
    }


def format_table(result: dict) -> str:
    rows = [("contender", "median ms/step", "p10 ms", "p90 ms", "ratio vs off", "per-round ratio",
             "close ms", "trace MB")]
    for name, c in result["configs"].items():
        rows.append((name, f"{c['median_ms']:.1f}", f"{c['p10_ms']:.1f}", f"{c['p90_ms']:.1f}",
                     f"{c['ratio']:.3f}", f"{c['ratio_per_round_median']:.3f}",
                     "-" if name == "off" else f"{c['close_ms']:.0f}",
                     "-" if name == "off" else f"{c['trace_mb']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    s = result["settings"]
    lines.append("")
    lines.append(f"{s['recorded_steps_per_window']} recorded steps per window x {s['rounds']} rounds; close = stop + "
                 "trace export + summary, once per window; device: " + result["device"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset_options(parser, DEFAULTS, QUICK)
    parser.add_argument("--json", default=None, help="where to write the JSON result")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    model_bench.sink_fork_warning()
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = measure(**preset(args, DEFAULTS, QUICK))
    result["settings"]["quick"] = args.quick
    print(format_table(result))
    write(result, Path(args.json) if args.json else quick_json(DEFAULT_JSON, args.quick))
    return result


if __name__ == "__main__":
    main()
