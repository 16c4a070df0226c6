"""The planner against real runs: for a small GPT on a 4-rank CPU world, ``python -m hyper_adaptor plan``'s
feasible configurations under a device-memory limit (at most ``--limit``, 30: the pick and an even spread of
the rest by predicted rank) are each run with megatron.training (hyper_adaptor/testing/peak_run.py: peak per
rank under the benches' storage tracker, step time untracked), and compared:

- predicted against measured step time per configuration, the Spearman rank correlation over them;
- where the planner's pick ranks among the measured (target: its measured step within 10 % of the measured best);
- that nothing it called feasible exceeded the memory limit when measured (the device tier's peak, every rank).

The step times are predicted with this machine's CPU calibration (``calibrate.get("cpu")``: measured once,
cached). Run on an otherwise idle machine: four ranks share its cores, and a loaded machine's step times say
nothing. Run from the repository root (about 30 configurations x 30-60 s)::

    python bench/plan_validate.py                 # writes bench/results/plan_validate.json
    python bench/plan_validate.py --quick         # 3 configurations, fewer iterations: plan_validate-quick.json
    python bench/plan_validate.py --limit 2       # any subset: beside the recorded result, as --quick
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.dry_run import MODEL, spearman  # noqa: E402  (one Spearman for both benches)
from hyper_adaptor.testing.measure import machine, machine_line, report  # noqa: E402
from hyper_adaptor.testing.measure import mib as _mib  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "plan_validate.json"
NPROC = 4
# about the median predicted peak of the space (7.8-48 MiB): about half the configurations do not fit
DEVICE_MEMORY_MIB = 20
MAX_CONFIGS = 30
TOLERANCE = 0.10


def model_flags() -> list[str]:
    """bench/dry_run.py's model without the micro-batch size (the planner chooses it)."""
    flags = list(MODEL)
    i = flags.index("--micro-batch-size")
    return flags[:i] + flags[i + 2:]


def spread(n: int, k: int) -> list[int]:
    """k indices of range(n), evenly spaced, the first (the pick) and the last included."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def planned(memory_mib: float, bound: int):
    """The planner's feasible configurations (fastest first) on NPROC CPU ranks, and its printed output."""
    from hyper_adaptor.dryrun import calibrate, plan

    cal = calibrate.get("cpu")
    out = io.StringIO()
    argv = [*model_flags(), "--world-size", str(NPROC), "--device-memory", str(memory_mib / 1024), "--device", "cpu",
            "--bound", str(bound), "--top", "5"]
    code, result = plan.plan(argv, calibration=cal, out=out)
    return code, result, out.getvalue(), cal


def run(args) -> dict:
    from hyper_adaptor.testing.peak_run import measure

    start, load_before = time.perf_counter(), os.getloadavg()
    code, result, text, cal = planned(args.device_memory_mib, args.bound)
    print(text, flush=True)
    if code != 0:
        raise SystemExit(f"the planner found nothing feasible under {args.device_memory_mib} MiB")
    chosen = [result.ranked[i] for i in spread(len(result.ranked), args.limit)]
    limit_bytes = args.device_memory_mib * 2 ** 20
    rows = []
    for index, outcome in enumerate(chosen):
        flags = outcome.candidate.flags()
        row = {"predicted_rank": result.ranked.index(outcome) + 1, "flags": " ".join(flags),
               "layout": outcome.candidate.layout.name(), "dp_mode": outcome.candidate.dp_mode,
               "recompute": outcome.candidate.recompute, "micro_batch": outcome.candidate.micro_batch,
               "predicted_step_s": outcome.step.total, "predicted_parts_s": outcome.step.parts,
               "predicted_peak": outcome.peak, "error": None}
        t0 = time.perf_counter()
        try:
            measured = measure([*MODEL, *flags], NPROC, iters=args.iters, timed_iters=args.timed_iters,
                               timeout=args.timeout)
        except RuntimeError as error:
            row.update(error=str(error)[-3000:], wall_s=time.perf_counter() - t0)
            print(f"[{index + 1}/{len(chosen)}] {row['flags']}: FAILED\n{str(error)[-1500:]}", flush=True)
            rows.append(row)
            continue
        row["wall_s"] = time.perf_counter() - t0
        row["measured_step_s"] = max(r["step_time_s"] for r in measured)   # the slowest rank sets the step
        row["measured_peak"] = max(r["peak"] for r in measured)
        row["measured_peaks"] = [r["peak"] for r in measured]
        row["within_limit"] = row["measured_peak"] <= limit_bytes
        print(f"[{index + 1}/{len(chosen)}] #{row['predicted_rank']} {row['flags']}: step predicted "
              f"{row['predicted_step_s']:.3f} s, measured {row['measured_step_s']:.3f} s; peak predicted "
              f"{_mib(row['predicted_peak'])}, measured {_mib(row['measured_peak'])} MiB "
              f"({'within' if row['within_limit'] else 'OVER'} {args.device_memory_mib} MiB); "
              f"{row['wall_s']:.0f} s", flush=True)
        rows.append(row)
    ok = [r for r in rows if r["error"] is None]
    rho = spearman([r["predicted_step_s"] for r in ok], [r["measured_step_s"] for r in ok])
    pick = next((r for r in ok if r["predicted_rank"] == 1), None)
    best = min(ok, key=lambda r: r["measured_step_s"]) if ok else None
    measured_order = sorted(ok, key=lambda r: r["measured_step_s"])
    summary = {
        "configurations_run": len(rows), "failed": len(rows) - len(ok), "spearman": rho,
        "pick_measured_rank": measured_order.index(pick) + 1 if pick else None,
        "pick_over_best": pick["measured_step_s"] / best["measured_step_s"] if pick and best else None,
        "over_limit": [r["flags"] for r in ok if not r["within_limit"]],
        "ratio_step_predicted_over_measured": [r["predicted_step_s"] / r["measured_step_s"] for r in ok],
    }
    targets = []
    if summary["pick_over_best"] is not None:
        targets.append({"target": f"the pick's measured step within {TOLERANCE:.0%} of the measured best",
                        "where": pick["flags"] or "(plain DDP)", "value": summary["pick_over_best"],
                        "met": summary["pick_over_best"] <= 1 + TOLERANCE})
    targets.append({"target": f"every configuration called feasible measured within {args.device_memory_mib} MiB",
                    "where": f"{len(ok)} runs", "value": len(summary["over_limit"]),
                    "met": not summary["over_limit"]})
    return {
        "bench": "plan_validate", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python bench/plan_validate.py" + (" --quick" if args.quick else "")
                   + (f" --limit {args.limit}" if args.limit != MAX_CONFIGS and not args.quick else ""),
        "model": " ".join(model_flags()), "nproc": NPROC, "device_memory_mib": args.device_memory_mib,
        "planner_output": text, "planner_feasible": len(result.ranked), "planner_evaluated": result.evaluated,
        "calibration": {"host": cal.host, "machine": cal.machine, "created": cal.created},
        "tracked_iterations": args.iters, "timed_iterations": args.timed_iters,
        "rows": rows, "summary": summary, "targets": targets, "wall_s": time.perf_counter() - start,
        "machine": machine(torch_threads=1, load_average_1min_before_after=[load_before[0], os.getloadavg()[0]]),
    }


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    lines = ["| predicted rank | configuration | pred step s | meas step s | pred / meas | pred peak MiB | "
             "meas peak MiB | within limit |", "|" + "---|" * 8]
    for r in result["rows"]:
        if r["error"]:
            lines.append(f"| {r['predicted_rank']} | `{r['flags']}` | {_f(r['predicted_step_s'])} | FAILED | | | | |")
            continue
        lines.append(f"| {r['predicted_rank']} | `{r['flags'] or '(DDP)'}` | {_f(r['predicted_step_s'])} | "
                     f"{_f(r['measured_step_s'])} | {_f(r['predicted_step_s'] / r['measured_step_s'], '.2f')} | "
                     f"{_mib(r['predicted_peak'])} | {_mib(r['measured_peak'])} | "
                     f"{'yes' if r['within_limit'] else 'NO'} |")
    s = result["summary"]
    lines += ["", f"Spearman (predicted vs measured step): {_f(s['spearman'])}; the pick's measured rank "
              f"{s['pick_measured_rank']} of {s['configurations_run'] - s['failed']}, its step / the measured best "
              f"{_f(s['pick_over_best'])}; over the limit: {len(s['over_limit'])}.",
              f"Model ({result['nproc']} CPU ranks, limit {result['device_memory_mib']} MiB): {result['model']}.",
              f"The planner: {result['planner_feasible']} feasible of {result['planner_evaluated']} evaluated; "
              f"calibration {result['calibration']['machine']} ({result['calibration']['created']}).",
              "", machine_line(result)]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=MAX_CONFIGS, help=f"configurations run (<= {MAX_CONFIGS})")
    parser.add_argument("--device-memory-mib", type=float, default=DEVICE_MEMORY_MIB)
    parser.add_argument("--bound", type=int, default=3000, help="the planner's search bound")
    parser.add_argument("--iters", type=int, default=3, help="tracked iterations (the peak is over these)")
    parser.add_argument("--timed-iters", type=int, default=3, help="untracked iterations after them (step time)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    parser.add_argument("--quick", action="store_true", help="3 configurations, 2 tracked + 1 timed iterations")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    if not 1 <= args.limit <= MAX_CONFIGS:
        parser.error(f"--limit must be 1..{MAX_CONFIGS}; got {args.limit}")
    if args.quick:
        args.limit, args.iters, args.timed_iters = min(args.limit, 3), 2, 1
    result = run(args)
    return report(result, table(result), args.json, quick=args.quick or args.limit != MAX_CONFIGS)


if __name__ == "__main__":
    main()
