"""The dry run's accuracy: each rank's peak memory as ``hyper_adaptor.dryrun.predict`` says it will be,
against the peak measured on a real megatron.training run of the same command line on CPU
(hyper_adaptor/testing/peak_run.py: the benches' storage tracker from the model build through the last
tracked iteration), over a matrix of configurations that together use every feature the prediction
models; the measured and predicted parts at the peak side by side; the measured step time against
``hyper_adaptor.dryrun.timing.predict_time`` on this machine's calibration (measured once and cached, about a
minute the first time): the ratio per row and the Spearman rank correlation over the rows.

Run from the repository root (204 s on an idle 2-core machine, calibration included)::

    python bench/dry_run.py                  # the whole matrix
    python bench/dry_run.py --quick          # 3 rows, a smaller model, 2 tracked iterations
    python bench/dry_run.py --rows dp2 tp2-sp  # some rows (names: --list)
    python bench/dry_run.py --recalibrate    # measure the step-time calibration again first (an idle machine)
    python bench/dry_run.py --script ../Megatron-LM/pretrain_gpt.py --rows dp2 pp2-zbh1
        # the measured runs use another pretrain script (e.g. a Megatron-LM core_r0.19.0 checkout's own, with
        # the one import line): the prediction is the same command line's; results go to dry_run-<script dir>.json
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from hyper_adaptor.testing.measure import machine, machine_line, report, target_lines  # noqa: E402
from hyper_adaptor.testing.measure import mib as _mib  # noqa: E402
from hyper_adaptor.testing.peak_run import measure  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "dry_run.json"
TOLERANCE = 0.10
SPEARMAN_TARGET = 0.9

# A GPT small enough for 2-4 CPU ranks under the tracker, large enough that parameters, optimizer state,
# activations (attention scores are seq^2 per head) and logits are each a visible share of the peak.
MODEL = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 512 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 "
    "--use-cpu-initialization --hidden-dropout 0.0 --attention-dropout 0.0 --log-interval 1 "
    "--eval-interval 1000 --eval-iters 0 --tokenizer-type NullTokenizer --vocab-size 1024 --mock-data "
    "--num-workers 0 --no-bias-gelu-fusion --no-bias-dropout-fusion --no-bias-swiglu-fusion"
).split()
QUICK_MODEL = [*MODEL, "--hidden-size", "64", "--ffn-hidden-size", "256", "--seq-length", "128",
               "--max-position-embeddings", "128", "--num-layers", "2"]
MOE = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
       "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
       "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
VPP2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
CP2 = ["--context-parallel-size", "2", "--context-parallel-algo"]
RECOMPUTE_FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]

# name -> (ranks, flags beyond MODEL). Together: TP / SP, PP under 1F1B, interleaved (VPP), GPipe, ZB-H1 and
# ZBV, each CP algorithm, EP, HSDP levels 1-3, the distributed optimizer, full and selective recompute,
# swap, optimizer offload (megatron's distributed path and the released main copies), bf16.
ROWS = {
    "dp2": (2, []),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2-1f1b": (2, PP2),
    "pp2-vpp2-interleaved": (2, [*PP2, *VPP2]),
    "pp2-gpipe": (2, [*PP2, "--pipeline-schedule", "gpipe"]),
    "pp2-zbh1": (2, [*PP2, "--pipeline-schedule", "zbh1"]),
    "pp2-vpp2-zbv": (2, [*PP2, *VPP2, "--untie-embeddings-and-output-weights", "--pipeline-schedule", "zbv"]),
    "cp2-ring": (2, [*CP2, "megatron_cp_algo"]),
    "cp2-ulysses": (2, [*CP2, "ulysses_cp_algo"]),
    "cp2-allgather": (2, [*CP2, "allgather"]),
    "cp4-hybrid": (4, ["--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo",
                       "--ulysses-degree-in-cp", "2"]),
    "ep2-moe": (2, [*MOE, "--expert-model-parallel-size", "2"]),
    "hsdp-level1": (2, ["--use-hsdp", "--hsdp-optimizer-level", "level1"]),
    "hsdp-level2": (2, ["--use-hsdp", "--hsdp-optimizer-level", "level2"]),
    "hsdp-level3": (2, ["--use-hsdp", "--hsdp-optimizer-level", "level3"]),
    "distopt": (2, ["--use-distributed-optimizer"]),
    "recompute-full": (2, RECOMPUTE_FULL),
    "recompute-selective-pp2": (2, [*PP2, "--recompute-granularity", "selective"]),
    "swap-attention": (2, ["--swap-attention", "--swap-prefetch-layers", "1", "--min-offloaded-tensor-size", "0"]),
    "bf16": (2, ["--bf16"]),
    "bf16-distopt-offload": (2, ["--bf16", "--use-distributed-optimizer", "--optimizer-cpu-offload"]),
    "bf16-offload-main-copies": (2, ["--bf16", "--optimizer-cpu-offload"]),
    "tp2-pp2-distopt-bf16": (4, ["--tensor-model-parallel-size", "2", *PP2, "--use-distributed-optimizer",
                                 "--bf16"]),
    # the combinations the planner's validation found mispredicted (bench/plan_validate.py): ZB-H1 keeps the
    # recomputed W operands; HSDP level 3 keeps unreduced gradients over micro-batches and its root unit, and
    # re-gathers under recompute
    "pp2-zbh1-recompute-full": (2, [*PP2, "--pipeline-schedule", "zbh1", *RECOMPUTE_FULL]),
    "cp2-dp2-hsdp-level3": (4, [*CP2, "megatron_cp_algo", "--use-hsdp", "--hsdp-optimizer-level", "level3"]),
    "hsdp-level3-recompute-full": (2, ["--use-hsdp", "--hsdp-optimizer-level", "level3", *RECOMPUTE_FULL]),
}
QUICK_ROWS = ("dp2", "pp2-1f1b", "hsdp-level3")
# the predicted parts each measured class is compared with
PREDICTED_CLASSES = {
    "parameters": ("parameters",),
    "gradients": ("gradients",),
    "optimizer_state": ("main_parameters", "optimizer_state"),
    "other": ("activations", "logits_and_loss", "communication_buffers", "transient"),
}


def mib(n) -> str:
    return _mib(n, ".1f")


# ------------------------------------------------------------------------------------------- prediction
def _predictor():
    """``predict(flags, nproc) -> [per-rank dict] | None``, or None where hyper_adaptor.dryrun is absent."""
    try:
        from hyper_adaptor.dryrun import parse, predict
    except ImportError:
        return None

    def predicted(flags: list[str], nproc: int):
        prediction = predict(parse(flags, world_size=nproc, device="cpu"))
        by_rank = {}
        for r in prediction.ranks:
            for rank in getattr(r, "ranks", None) or [r.rank]:
                by_rank[rank] = {"peak": r.peak, "parts": dict(r.parts), "host": dict(r.host)}
        return [by_rank.get(rank) for rank in range(nproc)]

    return predicted


def _calibration(recalibrate: bool = False):
    """This machine's CPU calibration (the cache, or measured now after a line saying so; ``recalibrate``:
    measured now whatever the cache holds), or None where hyper_adaptor.dryrun's timing is absent."""
    try:
        from hyper_adaptor.dryrun import calibrate
        from hyper_adaptor.dryrun.report import calibration
    except ImportError:
        return None
    if recalibrate:
        print(f"calibrating this machine's cpu (--recalibrate), cached in {calibrate.cache_path('cpu')}", flush=True)
        return calibrate.get("cpu", recalibrate=True)
    return calibration("cpu", sys.stdout)


def _predicted_time(flags: list[str], nproc: int, calibration) -> dict:
    """The predicted step time (s) and its parts on ``calibration``, as ``python -m hyper_adaptor dry-run``
    prints them."""
    from hyper_adaptor.dryrun import parse
    from hyper_adaptor.dryrun.timing import predict_time

    step = predict_time(parse(flags, world_size=nproc, device="cpu"), calibration)
    return {"total": step.total, "parts": dict(step.parts), "bubble_fraction": step.bubble_fraction,
            "notes": list(step.notes)}


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation of paired values: Pearson's correlation of their ranks, tied values
    sharing the mean of the ranks they span. None under two pairs or where one side is constant."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} values against {len(ys)}")

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    if len(xs) < 2:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return None if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


def time_summary(rows: list[dict]) -> dict:
    """Predicted against measured step time over the rows that have both: the Spearman rank correlation and
    the spread of the ratio predicted / measured."""
    pairs = [(r["predicted_step_s"], r["step_time_s"], r["name"]) for r in rows
             if r.get("predicted_step_s") and r.get("step_time_s")]
    ratios = [p / m for p, m, _ in pairs]
    return {
        "rows": [name for _, _, name in pairs],
        "spearman": spearman([p for p, _, _ in pairs], [m for _, m, _ in pairs]),
        "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None,
        "ratio_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
        # the mean of |log ratio|, as a factor: 1.25 is "off by 25 % on average, either way"
        "ratio_error_factor": math.exp(sum(abs(math.log(x)) for x in ratios) / len(ratios)) if ratios else None,
    }


# ------------------------------------------------------------------------------------------------- rows
def run_row(name: str, nproc: int, extra: list[str], model: list[str], iters: int, timed: int,
            predicted, timeout: float, calibration=None, script=None) -> dict:
    flags = [*model, *extra]
    start = time.perf_counter()
    row = {"name": name, "nproc": nproc, "flags": extra, "error": None}
    try:
        measured = measure(flags, nproc, iters=iters, timed_iters=timed, timeout=timeout,
                           **({"script": script} if script else {}))
    except RuntimeError as error:  # one failed row is reported, the others still run
        row.update(error=str(error)[-3000:], wall_s=time.perf_counter() - start)
        print(f"{name}: FAILED\n{str(error)[-1500:]}", flush=True)
        return row
    row["wall_s"] = time.perf_counter() - start
    prediction, prediction_error = None, None
    if predicted is not None:
        try:
            prediction = predicted([*flags, "--train-iters", str(iters + timed)], nproc)
        except Exception as error:  # a prediction that fails is a finding, not a crash
            prediction_error = f"{type(error).__name__}: {error}"
    row["prediction_error"] = prediction_error
    row["predicted_step_s"] = row["predicted_step_parts"] = row["time_prediction_error"] = None
    if calibration is not None:
        try:
            step = _predicted_time([*flags, "--train-iters", str(iters + timed)], nproc, calibration)
            row["predicted_step_s"], row["predicted_step_parts"] = step["total"], step["parts"]
            row["predicted_bubble_fraction"], row["predicted_step_notes"] = step["bubble_fraction"], step["notes"]
        except (Exception, SystemExit) as error:  # a time the model cannot price is a finding, not a crash
            row["time_prediction_error"] = f"{type(error).__name__}: {error}"
    row["ranks"] = []
    for m in measured:
        p = prediction[m["rank"]] if prediction else None
        predicted_parts = None if p is None else {
            cls: sum(p["parts"].get(k, 0) for k in keys) for cls, keys in PREDICTED_CLASSES.items()}
        row["ranks"].append({
            **{k: m[k] for k in ("rank", "peak", "parts_at_peak", "main_parameters_at_peak", "other_by_op",
                                 "peak_iteration", "live_after_tracked", "host_peak", "step_time_s", "step_times_s",
                                 "step_time_tracked", "tracker_left_on")},
            "predicted_peak": None if p is None else p["peak"],
            "predicted_parts": None if p is None else p["parts"],
            "predicted_host": None if p is None else p["host"],
            "predicted_by_class": predicted_parts,
            "ratio": None if p is None else p["peak"] / m["peak"],
        })
    row["step_time_s"] = max(r["step_time_s"] for r in row["ranks"])  # the slowest rank sets the step
    ratios = [r["ratio"] for r in row["ranks"] if r["ratio"] is not None]
    row["worst_ratio"] = max(ratios, key=lambda x: abs(x - 1)) if ratios else None
    row["step_time_ratio"] = (row["predicted_step_s"] / row["step_time_s"]
                              if row["predicted_step_s"] and row["step_time_s"] else None)
    print(f"{name}: {nproc} ranks, peak MiB " + ", ".join(mib(r["peak"]) for r in row["ranks"])
          + ("" if not ratios else f"; predicted / measured worst {row['worst_ratio']:.3f}")
          + f"; step {_f(row['step_time_s'])} s, predicted {_f(row['predicted_step_s'])} s"
          + f"; {row['wall_s']:.0f} s", flush=True)
    return row


def run(args) -> dict:
    start, load_before = time.perf_counter(), os.getloadavg()
    names = args.rows or (list(QUICK_ROWS) if args.quick else list(ROWS))
    model = QUICK_MODEL if args.quick else MODEL
    predicted = _predictor()
    if predicted is None:
        print("hyper_adaptor.dryrun is not available: the predicted columns are '-'", flush=True)
    calibration = _calibration(args.recalibrate)  # before the rows: a first calibration must not overlap a measured row
    rows = [run_row(name, *ROWS[name], model, args.iters, args.timed_iters, predicted, args.timeout, calibration,
                    args.script) for name in names]
    targets = [{"target": f"predicted / measured peak within {TOLERANCE:.0%} on every rank", "where": r["name"],
                "value": r["worst_ratio"], "met": abs(r["worst_ratio"] - 1) <= TOLERANCE}
               for r in rows if r.get("worst_ratio") is not None]
    step_time = time_summary(rows)
    if step_time["spearman"] is not None:
        targets.append({"target": f"Spearman rank correlation of predicted and measured step time >= "
                                  f"{SPEARMAN_TARGET}", "where": f"{len(step_time['rows'])} rows",
                        "value": step_time["spearman"], "met": step_time["spearman"] >= SPEARMAN_TARGET})
    if calibration is not None:
        step_time["calibration"] = {k: getattr(calibration, k) for k in (
            "machine", "created", "seconds", "cores", "threads", "collective_source", "framework", "compute_steps")}
    return {
        "bench": "dry_run", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python bench/dry_run.py" + (" --quick" if args.quick else "")
                   + (f" --rows {' '.join(args.rows)}" if args.rows else "")
                   + (" --recalibrate" if args.recalibrate else "")
                   + (f" --script {args.script}" if args.script else ""),
        "script": args.script or "examples/pretrain_gpt.py",
        "model": " ".join(model), "tracked_iterations": args.iters, "timed_iterations": args.timed_iters,
        "method": "peak: hyper_adaptor.testing.peak_run (live CPU tensor storages created from the model build "
                  "through the last tracked iteration; host tier apart); step time: median of the untracked "
                  "iterations, slowest rank",
        "prediction_available": predicted is not None,
        "step_time": step_time,
        "rows": rows, "targets": targets, "wall_s": time.perf_counter() - start,
        "machine": machine(torch_threads=1, load_average_1min_before_after=[load_before[0], os.getloadavg()[0]]),
    }


# ------------------------------------------------------------------------------------------------ table
def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    # peak iter: the tracked iteration that set the peak (the last one, with live bytes after it well above the
    # model state, is memory growing from step to step)
    head = ("row", "ranks", "rank", "measured MiB", "predicted MiB", "pred / meas", "host MiB meas / pred",
            "peak iter", "live after MiB", "step s", "pred step s", "pred / meas step")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        if row["error"]:
            lines.append(f"| {row['name']} | {row['nproc']} | - | FAILED | | | | | | | | |")
            continue
        for r in row["ranks"]:
            host_pred = None if r["predicted_host"] is None else sum(r["predicted_host"].values())
            lines.append("| " + " | ".join((
                row["name"], str(row["nproc"]), str(r["rank"]), mib(r["peak"]), mib(r["predicted_peak"]),
                _f(r["ratio"]), f"{mib(r['host_peak'])} / {mib(host_pred)}", str(r["peak_iteration"]),
                mib(r.get("live_after_tracked")), _f(r["step_time_s"]), _f(row["predicted_step_s"]),
                _f(row.get("step_time_ratio")))) + " |")
    parts = ["", "Parts at the peak, MiB, measured / predicted (parameters; gradients; optimizer state with fp32 "
             "main parameters; other = activations, logits and loss, communication buffers, temporaries):", "",
             "| row | rank | parameters | gradients | optimizer state (main params) | other | largest other (op MiB) |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        for r in row.get("ranks") or []:
            m, p = r["parts_at_peak"], r["predicted_by_class"] or {}
            cells = [f"{mib(m[c])} / {mib(p.get(c))}" for c in ("parameters", "gradients")]
            cells.append(f"{mib(m['optimizer_state'])} ({mib(r['main_parameters_at_peak'])}) / "
                         f"{mib(p.get('optimizer_state'))}")
            cells.append(f"{mib(m['other'])} / {mib(p.get('other'))}")
            ops = ", ".join(f"{op.removeprefix('aten.')} {mib(b)}" for op, b in list(r["other_by_op"].items())[:3])
            lines_row = "| " + " | ".join((row["name"], str(r["rank"]), *cells, ops)) + " |"
            parts.append(lines_row)
    notes = ["", "Rows: " + "; ".join(f"{row['name']}: {' '.join(row['flags']) or '(DDP)'}"
                                      for row in result["rows"]),
             f"Model: {result['model']}.",
             f"Measured with: {result.get('script', 'examples/pretrain_gpt.py')}.",
             f"Peak: {result['method']}. {result['tracked_iterations']} tracked + {result['timed_iterations']} "
             f"timed iterations.",
             "Failed rows: " + (", ".join(f"{row['name']}" for row in result["rows"] if row["error"]) or "none") + "."]
    failed_predictions = [row for row in result["rows"] if row.get("prediction_error")]
    if failed_predictions:
        notes.append("Predictions that raised: " + "; ".join(
            f"{row['name']}: {row['prediction_error'][:200]}" for row in failed_predictions))
    failed_times = [row for row in result["rows"] if row.get("time_prediction_error")]
    if failed_times:
        notes.append("Step times that raised: " + "; ".join(
            f"{row['name']}: {row['time_prediction_error'][:200]}" for row in failed_times))
    notes += time_lines(result)
    if not result["prediction_available"]:
        notes.append("hyper_adaptor.dryrun was not importable: no predicted columns.")
    if result["targets"]:
        notes += ["", "Target:"] + target_lines(result["targets"], ".3f")
    notes += ["", machine_line(result)]
    return "\n".join(lines + parts + notes)


def time_lines(result: dict) -> list[str]:
    """The step-time summary under the tables: rank correlation, ratio spread, each row's predicted parts,
    and the calibration the prediction used."""
    st = result.get("step_time") or {}
    if not st.get("rows"):
        return ["", "Step time: no row has both a measured and a predicted step time."]
    lines = ["", f"Step time, predicted / measured over {len(st['rows'])} rows (measured: slowest rank, median of "
                 f"the untracked iterations): Spearman rank correlation {_f(st['spearman'])}; ratio "
                 f"{_f(st['ratio_min'])} to {_f(st['ratio_max'])}, geometric mean {_f(st['ratio_geomean'])}, "
                 f"mean error factor {_f(st['ratio_error_factor'])}.", "",
             "| row | measured s | predicted s | pred / meas | predicted parts, ms |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        if row.get("predicted_step_s") and row.get("step_time_s"):
            parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row["predicted_step_parts"].items() if v > 5e-5)
            lines.append(f"| {row['name']} | {row['step_time_s']:.3f} | {row['predicted_step_s']:.3f} | "
                         f"{row['step_time_ratio']:.2f} | {parts} |")
    cal = st.get("calibration")
    if cal:
        lines.append("")
        lines.append(f"Calibration: {cal['machine']}, measured {cal['created']} in {cal['seconds']:.0f} s, "
                     f"{cal['cores']} cores, collectives {cal['collective_source']}.")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), metavar="ROW",
                        help="rows to run (default: all; --list names them)")
    parser.add_argument("--list", action="store_true", help="print the rows and exit")
    parser.add_argument("--iters", type=int, default=3, help="tracked iterations (the peak is over these)")
    parser.add_argument("--timed-iters", type=int, default=2, help="untracked iterations after them (step time)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per row")
    parser.add_argument("--quick", action="store_true", help=f"rows {', '.join(QUICK_ROWS)}, a 2-layer hidden-64 "
                                                             "model, 2 tracked iterations")
    parser.add_argument("--recalibrate", action="store_true",
                        help="measure this machine's calibration again before the rows (on an idle machine, as the "
                             "rows are), replacing the cached one the predicted step time otherwise uses")
    parser.add_argument("--script", help="the pretrain script the measured runs use (default: "
                                          "examples/pretrain_gpt.py), e.g. a Megatron-LM checkout's pretrain_gpt.py "
                                          "with the one import line; its megatron is the checkout's")
    parser.add_argument("--json", help=f"where the result goes (default: {DEFAULT_JSON.relative_to(REPO_ROOT)}, "
                                       "or dry_run-<the script's directory>.json with --script)")
    args = parser.parse_args(argv)
    if args.script:
        args.script = str(Path(args.script).resolve())
        if not Path(args.script).is_file():
            parser.error(f"--script {args.script}: no such file")
    if args.json is None:
        args.json = str(DEFAULT_JSON if not args.script else
                        DEFAULT_JSON.with_name(f"dry_run-{Path(args.script).parent.name.lower()}.json"))
    if args.list:
        for name, (nproc, flags) in ROWS.items():
            print(f"{name:26s} {nproc}  {' '.join(flags)}")
        return None
    if args.quick:
        args.iters = min(args.iters, 2)
        args.timed_iters = min(args.timed_iters, 1)
    result = run(args)
    # a subset of the rows is a partial result: beside the recorded matrix (as --quick's), never over it
    return report(result, table(result), args.json, quick=args.quick or (bool(args.rows) and not args.script))


if __name__ == "__main__":
    main()
