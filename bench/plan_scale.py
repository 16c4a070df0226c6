"""What ``python -m hyper_adaptor plan`` picks at cluster scale: 64 and 1,024 devices of 64 GiB, a 7B dense model
(Llama-2-7B's shape) and a 16B MoE (DeepSeek-MoE-16B-like: 64 experts, top-6), for CUDA and NPU devices.

The step times use the calibration's *nominal* figures for each device (``calibrate.nominal``: assumed matmul
rates, HBM bandwidth and one link for every collective), not a measurement: the table shows what the planner
does with them (its search, pruning and ranking), not how fast a real cluster runs. Memory is the dry-run's
model. No process is started; each search is one process on one core.

Run from the repository root (a few minutes; ``--quick``: the 64-device rows for CUDA, bound 300)::

    python bench/plan_scale.py
    python bench/plan_scale.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from hyper_adaptor.testing.measure import machine, machine_line, report  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "plan_scale.json"
COMMON = ("--lr 3e-4 --tokenizer-type NullTokenizer --swiglu --normalization RMSNorm --disable-bias-linear "
          "--untie-embeddings-and-output-weights --position-embedding-type rope --bf16 --attention-dropout 0 "
          "--hidden-dropout 0 --global-batch-size 1024 --seq-length 4096 --max-position-embeddings 4096")
MODELS = {
    "7B dense": ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 "
                 "--vocab-size 32000 " + COMMON),
    "16B MoE": ("--num-layers 28 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 10944 "
                "--num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1408 "
                "--moe-shared-expert-intermediate-size 2816 --moe-layer-freq ([0]+[1]*27) "
                "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --vocab-size 102400 " + COMMON),
}
WORLDS = (64, 1024)
DEVICES = ("cuda", "npu")
MEMORY_GIB = 64


def one(model: str, world: int, device: str, bound: int) -> dict:
    from hyper_adaptor.dryrun import calibrate, plan

    cal = calibrate.nominal(device)
    flags = MODELS[model].split()
    argv = [*flags, "--world-size", str(world), "--device-memory", str(MEMORY_GIB), "--device", device,
            "--bound", str(bound), "--top", "3"]
    out = io.StringIO()
    start = time.perf_counter()
    code, result = plan.plan(argv, calibration=cal, out=out)
    wall = time.perf_counter() - start
    row = {"model": model, "world": world, "device": device, "device_memory_gib": MEMORY_GIB, "exit": code,
           "command": "python -m hyper_adaptor plan " + " ".join(argv[len(flags):]) + " <" + model + " flags>",
           "layouts": result.layouts, "configurations": result.configurations, "evaluated": result.evaluated,
           "bound": bound, "search_s": result.seconds, "wall_s": wall,
           "configs_per_s": result.evaluated / result.seconds if result.seconds else None,
           "output": out.getvalue()}
    if result.ranked:
        best = result.ranked[0]
        row["pick"] = _describe(best, world)
        if len(result.ranked) > 1:
            runner = result.ranked[1]
            part = plan.gap(runner, best)
            row["runner_up"] = {**_describe(runner, world), "lost_by": part,
                                "lost_by_s": runner.step.parts.get(part, 0.0) - best.step.parts.get(part, 0.0)}
        # the best of another layout: the runner-up is often the pick with one engine or micro-batch changed
        other = next((o for o in result.ranked[1:] if o.candidate.layout != best.candidate.layout), None)
        if other is not None:
            part = plan.gap(other, best)
            row["best_other_layout"] = {**_describe(other, world), "lost_by": part,
                                        "lost_by_s": other.step.parts.get(part, 0.0) - best.step.parts.get(part, 0.0)}
    print(f"{model} on {world} x {device}: {row.get('pick', {}).get('layout', 'nothing fits')} "
          f"({result.evaluated} evaluated in {result.seconds:.0f} s)\n{row['output']}", flush=True)
    return row


def _describe(outcome, world: int) -> dict:
    c = outcome.candidate
    return {"layout": c.layout.name(), "dp": world // (c.layout.tp * c.layout.pp * c.layout.cp),
            "dp_mode": c.dp_mode, "recompute": c.recompute, "micro_batch": c.micro_batch,
            "flags": " ".join(c.flags()), "peak_gib": outcome.peak / 2 ** 30, "step_s": outcome.step.total,
            "parts_s": outcome.step.parts}


def _short(d: dict) -> str:
    return f"{d['layout']}, DP {d['dp']}, {d['dp_mode']}, recompute {d['recompute']}, mbs {d['micro_batch']}"


def table(result: dict) -> str:
    from hyper_adaptor.dryrun import plan

    lines = ["| model | devices | pick | peak GiB | step s (assumed) | runner-up: why it lost | best other layout: "
             "why it lost | evaluated / space | search s |", "|" + "---|" * 9]
    for r in result["rows"]:
        if "pick" not in r:
            lines.append(f"| {r['model']} | {r['world']} x {r['device']} | nothing fits | | | | | "
                         f"{r['evaluated']} / {r['configurations']} | {r['search_s']:.0f} |")
            continue
        p = r["pick"]
        cells = []
        for key in ("runner_up", "best_other_layout"):
            o = r.get(key)
            why = o and (o["lost_by"] if o["lost_by"] == plan.TIE else f"{o['lost_by']} +{o['lost_by_s']:.2f} s")
            cells.append("-" if o is None else f"{_short(o)}: {o['step_s']:.2f} s, {why}")
        lines.append(f"| {r['model']} | {r['world']} x {r['device']} | {_short(p)} | {p['peak_gib']:.1f} | "
                     f"{p['step_s']:.2f} | {cells[0]} | {cells[1]} | {r['evaluated']} / {r['configurations']} | "
                     f"{r['search_s']:.0f} |")
    lines += ["", "Flags of each pick (append to the model flags):", ""]
    for r in result["rows"]:
        if "pick" in r:
            lines.append(f"- {r['model']}, {r['world']} x {r['device']}: `{r['pick']['flags']}`")
    lines += ["", "Step times: nominal device figures (hyper_adaptor/dryrun/calibrate.py NOMINAL), assumed, not "
              "measured. Models: " + "; ".join(f"{k}: `{v}`" for k, v in MODELS.items()) + ".", "",
              machine_line(result)]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 devices, cuda, bound 300")
    parser.add_argument("--bound", type=int, default=None, help="configurations evaluated per search (default "
                                                                "the planner's)")
    parser.add_argument("--devices", nargs="+", choices=DEVICES, default=list(DEVICES))
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    from hyper_adaptor.dryrun import plan

    bound = args.bound or (300 if args.quick else plan.DEFAULT_BOUND)
    start, load_before = time.perf_counter(), os.getloadavg()
    rows, partial = [], Path(str(args.json) + ".partial")  # the rows so far, should a long run be stopped
    for device in ("cuda",) if args.quick else args.devices:
        for model in MODELS:
            for world in (64,) if args.quick else WORLDS:
                rows.append(one(model, world, device, bound))
                partial.write_text(json.dumps(rows, indent=1, default=str))
    partial.unlink(missing_ok=True)
    result = {"bench": "plan_scale", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": "python bench/plan_scale.py" + (" --quick" if args.quick else "")
                         + (f" --bound {args.bound}" if args.bound else "")
                         + (f" --devices {' '.join(args.devices)}" if args.devices != list(DEVICES) else ""),
              "device_memory_gib": MEMORY_GIB, "calibration": "nominal (assumed) figures per device",
              "rows": rows, "wall_s": time.perf_counter() - start,
              "machine": machine(load_average_1min_before_after=[load_before[0], os.getloadavg()[0]])}
    return report(result, table(result), args.json, quick=args.quick)


if __name__ == "__main__":
    main()
