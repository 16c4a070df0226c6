"""Pipeline schedules: measured bubble and live activations per rank against the theory, on 4 gloo ranks
running the real runtime on the real action lists with stages of known cost (sleeps), and megatron's GPT at
PP4 under each schedule.

Run from the repository root (docs/features/pipeline.md says what each figure is and why)::

    python bench/pipeline.py            # micro-batches 4, 8, 16, 3 timed rounds, t = 40 ms, GPT rows
    python bench/pipeline.py --quick    # micro-batches 4 and 8, one timed round, t = 20 ms, no GPT rows
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # python bench/pipeline.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hyper_adaptor.parallel.pipeline.schedules import SCHEDULES
from hyper_adaptor.testing.measure import (
    free_port,
    machine,
    machine_line,
    report,
    run_world,
    target_lines,
)

WORLD = 4
CHUNKS = {"interleaved": 2, "zbv": 2}
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "pipeline.json"
TARGETS = {"bubble_vs_theory_points": 0.10, "zbv_bubble": 0.05}
PAYLOAD = 8  # elements of the tensor each send carries


class TimedRunner:
    """A stage of known cost (``StageRunner``): sleeps its cost, counts busy time and live activations."""

    def __init__(self, stage_index: int, costs: dict, rank_counter: dict):
        self.stage_index = stage_index
        self.costs = costs
        self.counter = rank_counter  # shared by the rank's stages: busy, live, peaks

    def _work(self, kind: str) -> None:
        start = time.perf_counter()
        time.sleep(self.costs[kind])
        self.counter["busy"] += time.perf_counter() - start

    def _live(self, d_until_w: int, d_until_i: int) -> None:
        c = self.counter
        c["live_w"] += d_until_w
        c["live_i"] += d_until_i
        c["peak_w"] = max(c["peak_w"], c["live_w"])
        c["peak_i"] = max(c["peak_i"], c["live_i"])

    def forward(self, micro, inp):
        import torch

        if inp is not None and int(inp[0]) != micro:
            raise RuntimeError(f"stage {self.stage_index}: micro-batch {micro} got the activation of {int(inp[0])}")
        self._work("F")
        self._live(1, 1)
        return torch.full((PAYLOAD,), float(micro))

    def backward(self, micro, grad, split_weight):
        import torch

        if grad is not None and int(grad[0]) != micro:
            raise RuntimeError(f"stage {self.stage_index}: micro-batch {micro} got the gradient of {int(grad[0])}")
        self._work("I" if split_weight else "B")
        self._live(0 if split_weight else -1, -1)
        return None if self.stage_index == 0 else torch.full((PAYLOAD,), float(micro))

    def backward_weight(self, micro):
        self._work("W")
        self._live(-1, 0)

    def recv_meta(self, kind, micro):
        import torch

        return torch.Size([PAYLOAD]), torch.float32


def step_costs(name: str, t: float) -> dict:
    scale = 1.0 / CHUNKS.get(name, 1)
    return {"F": t * scale, "B": 2 * t * scale, "I": t * scale, "W": t * scale}


def bench_rank(rank: int, world_size: int, schedules, micros, t: float, rounds: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from hyper_adaptor.parallel.pipeline.runtime import execute
    from hyper_adaptor.parallel.pipeline.schedules import build

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    out = []
    for name in schedules:
        for m in micros:
            layout, lists = build(name, world_size, m, CHUNKS.get(name))
            costs = step_costs(name, t)
            samples = []
            for round_ in range(rounds + 1):  # round 0 warms up (p2p channels, first-call overheads)
                counter = dict(busy=0.0, live_w=0, live_i=0, peak_w=0, peak_i=0)
                runners = {s: TimedRunner(s, costs, counter) for s in layout.stages_of(rank)}
                dist.barrier()
                start = time.monotonic()
                execute(lists[rank], runners, layout, None)
                end = time.monotonic()
                if round_:
                    samples.append(dict(start=start, end=end, busy=counter["busy"], peak_w=counter["peak_w"],
                                        peak_i=counter["peak_i"]))
            out.append(dict(schedule=name, micro=m, samples=samples))
    dist.barrier()
    return out


def theory_live(name: str, p: int, r: int, m: int) -> int | None:
    """Textbook live activations on rank r (chunk activations for interleaved / ZBV), None if no formula."""
    if name == "gpipe":
        return m
    if name in ("1f1b", "zbh1"):
        return min(p - r, m)
    if name == "interleaved":
        v = CHUNKS[name]
        return min(v * m, 2 * (p - r - 1) + (v - 1) * p + 1)
    if name == "zbv":
        return 2 * p
    return None


def merge(per_rank: list[list[dict]], t: float) -> list[dict]:
    from hyper_adaptor.parallel.pipeline.schedules import build
    from hyper_adaptor.parallel.pipeline.timeline import inflight_peaks, simulate, theoretical_bubble

    rows = []
    p = len(per_rank)
    for i, first in enumerate(per_rank[0]):
        name, m = first["schedule"], first["micro"]
        rounds = len(first["samples"])
        bubbles, makespans = [], []
        for k in range(rounds):
            samples = [per_rank[r][i]["samples"][k] for r in range(p)]
            makespan = max(s["end"] for s in samples) - min(s["start"] for s in samples)
            bubbles.append(sum(1 - s["busy"] / makespan for s in samples) / p)
            makespans.append(makespan)
        layout, lists = build(name, p, m, CHUNKS.get(name))
        costs = step_costs(name, 1.0)
        ideal = simulate(lists, layout, costs)
        blocking = simulate(lists, layout, costs, blocking=True)
        list_i, list_w = inflight_peaks(lists)
        measured = statistics.median(bubbles)
        theory = theoretical_bubble(name, p, m, CHUNKS.get(name, 1), costs)
        rows.append(dict(
            schedule=name, micro=m, ranks=p, chunks=CHUNKS.get(name, 1), t_s=t, rounds=rounds,
            bubble_measured=measured, bubble_rounds=bubbles, bubble_theory=theory,
            bubble_sim_ideal=ideal.bubble, bubble_sim_blocking=blocking.bubble,
            makespan_ms=statistics.median(makespans) * 1e3,
            makespan_sim_ms=blocking.makespan * t * 1e3,
            # what the runtime and gloo add per compute action on the busiest rank
            overhead_ms_per_action=(statistics.median(makespans) - blocking.makespan * t) * 1e3
            / max(sum(1 for a in steps if a.step_type.is_compute) for steps in lists),
            live_measured=[max(x["samples"][k]["peak_w"] for k in range(rounds)) for x in
                           (per_rank[r][i] for r in range(p))],
            live_until_i_measured=[max(x["samples"][k]["peak_i"] for k in range(rounds)) for x in
                                   (per_rank[r][i] for r in range(p))],
            live_list=list_w, live_until_i_list=list_i,
            live_theory=[theory_live(name, p, r, m) for r in range(p)],
        ))
    return rows


# the real model: megatron's GPT through examples/pretrain_gpt.py (torchrun, PP4, 4 CPU processes), 8 layers
GPT = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 1024 --seq-length 256 "
       "--max-position-embeddings 256 --micro-batch-size 1 --lr 1e-4 --seed 1234 --use-cpu-initialization "
       "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-interval 100000 --eval-iters 0 "
       "--tokenizer-type NullTokenizer --vocab-size 1024 --mock-data --num-workers 0 "
       "--untie-embeddings-and-output-weights --pipeline-model-parallel-size 4").split()
# row name -> extra flags; megatron's own schedules first (the 1F1B one is every ratio's denominator)
GPT_RUNS = {
    "megatron 1f1b": [],
    "megatron interleaved": ["--num-virtual-stages-per-pipeline-rank", "2"],
    "1f1b": ["--pipeline-schedule", "1f1b"],
    "gpipe": ["--pipeline-schedule", "gpipe"],
    "zbh1": ["--pipeline-schedule", "zbh1"],
    "interleaved": ["--pipeline-schedule", "interleaved", "--num-virtual-stages-per-pipeline-rank", "2"],
    "zbv": ["--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank", "2"],
}


def _gpt_step_ms(extra: list, micro: int, iters: int, timeout: float) -> tuple[float, list]:
    """Median of megatron's logged 'elapsed time per iteration' over the iterations after the first two."""
    import re
    import subprocess

    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
               str(free_port()), "examples/pretrain_gpt.py", *GPT, "--global-batch-size", str(micro),
               "--train-iters", str(iters), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout, env=env)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(extra) or 'megatron 1f1b'} failed:\n{output[-3000:]}")
    times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", output)]
    losses = [float(v) for v in re.findall(r"lm loss: ([0-9.E+-]+)", output)]
    if len(times) < 3:
        raise RuntimeError(f"{' '.join(extra)}: too few iterations logged:\n{output[-3000:]}")
    return statistics.median(times[2:]), losses


def real_model_rows(args) -> list[dict]:
    """Megatron GPT step time at PP4 under each schedule, as a ratio to megatron's own 1F1B in the same run."""
    if not args.gpt_micros:
        return []
    rows = []
    for micro in args.gpt_micros:
        base = None
        for name, extra in GPT_RUNS.items():
            ms, losses = _gpt_step_ms(extra, micro, args.gpt_iters, args.timeout)
            base = ms if base is None else base
            rows.append({"model": "megatron GPT", "schedule": name, "micro": micro, "step_ms": ms,
                         "ratio_to_megatron_1f1b": ms / base, "losses": losses})
            print(f"  GPT PP4 m={micro} {name}: {ms:.0f} ms/step ({ms / base:.2f}x megatron's 1F1B)", flush=True)
    return rows


def targets(rows: list) -> list[dict]:
    out = []
    for r in rows:
        if r.get("bubble_theory") is None:
            continue
        gap = r["bubble_measured"] - r["bubble_theory"]
        out.append({"target": f"measured bubble within {TARGETS['bubble_vs_theory_points']:.0%} (points) of theory",
                    "where": f"{r['schedule']} m={r['micro']}", "value": gap,
                    "met": abs(gap) <= TARGETS["bubble_vs_theory_points"]})
        if r["schedule"] == "zbv":
            out.append({"target": f"ZBV bubble < {TARGETS['zbv_bubble']:.0%}", "where": f"m={r['micro']}",
                        "value": r["bubble_measured"], "met": r["bubble_measured"] < TARGETS["zbv_bubble"]})
    return out


def run(args) -> dict:
    load_before = os.getloadavg()
    start = time.perf_counter()
    per_rank = run_world(WORLD, "bench.pipeline:bench_rank", timeout=args.timeout, schedules=args.schedules,
                         micros=args.micros, t=args.t_ms / 1e3, rounds=args.rounds)
    rows = merge(per_rank, args.t_ms / 1e3)
    gpt_rows = real_model_rows(args)
    result = {
        "benchmark": "pipeline", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python bench/pipeline.py" + (" --quick" if args.quick else ""),
        "world": WORLD, "t_ms": args.t_ms, "micros": args.micros, "rounds": args.rounds,
        "costs": "F t, B 2t, I t, W t per stage; interleaved and ZBV (2 chunks): half per chunk",
        "bubble_method": "mean over ranks of 1 - busy/makespan; makespan = last end - first start after a "
                         "barrier; median over rounds",
        "rows": rows, "gpt_rows": gpt_rows, "gpt_model": " ".join(GPT), "wall_s": time.perf_counter() - start,
        "machine": machine(torch_threads=1, ranks=WORLD,
                           load_average_1min_before_after=[load_before[0], os.getloadavg()[0]]),
    }
    result["targets"] = targets(rows)
    return result


def _f(x, spec) -> str:
    return "-" if x is None else format(x, spec)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(result: dict) -> str:
    head = ("schedule", "m", "bubble measured", "theory", "sim ideal", "sim blocking", "step ms (sim)",
            "overhead ms / action",
            "live per rank: measured", "list", "theory", "until I: measured")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        lines.append("| " + " | ".join((
            r["schedule"], str(r["micro"]), _pct(r["bubble_measured"]), _pct(r.get("bubble_theory")),
            _pct(r.get("bubble_sim_ideal")), _pct(r.get("bubble_sim_blocking")),
            f"{r.get('makespan_ms', 0):.0f} ({r.get('makespan_sim_ms', 0):.0f})",
            _f(r.get("overhead_ms_per_action"), ".2f"),
            str(r.get("live_measured", "-")), str(r.get("live_list", "-")), str(r.get("live_theory", "-")),
            str(r.get("live_until_i_measured", "-")),
        )) + " |")
    notes = ["", f"{result['world']} gloo ranks, stages of fixed cost t = {result['t_ms']} ms ({result['costs']}); "
             f"{result['rounds']} timed round(s) after a warm-up; bubble = {result['bubble_method']}.",
             "theory: timeline.theoretical_bubble; sim: timeline.simulate on the same lists (ideal: asynchronous "
             "sends; blocking: the lists' communication batches as rendez-vous).",
             "overhead ms / action: (measured - simulated blocking step time) / compute actions of the busiest "
             "rank: what the runtime, gloo and process wake-ups add to each action.",
             "live: most activations alive at once per rank (F until B, or until W when split), in stage units "
             "(interleaved / ZBV: chunk units, half a stage each); list: what the list implies; theory: GPipe m, "
             "1F1B / ZB-H1 min(p-r, m) (ZB-H1 until I), interleaved min(vm, 2(p-r-1)+(v-1)p+1), ZBV 2p.",
             "", "Targets (each checked where it applies):"]
    notes += target_lines(result["targets"], "+.3f")
    if result.get("gpt_rows"):
        notes += ["", "Megatron GPT (examples/pretrain_gpt.py through torchrun, PP4, 4 CPU processes, "
                  "megatron's logged step time, median after the first two iterations):", "",
                  "| schedule | m | step ms | x megatron's 1F1B |", "|---|---|---|---|"]
        for r in result["gpt_rows"]:
            notes.append(f"| {r['schedule']} | {r['micro']} | {r['step_ms']:.0f} | {r['ratio_to_megatron_1f1b']:.2f} |")
    notes += ["", machine_line(result)]
    return "\n".join(lines + notes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--micros", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--t-ms", type=float, default=40.0, help="F cost of one stage (B 2t, I t, W t)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--quick", action="store_true", help="micro-batches 4 8, one timed round, t 20 ms")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    parser.add_argument("--gpt-micros", type=int, nargs="*", default=[8],
                        help="micro-batches of the megatron GPT rows (none: skip them)")
    parser.add_argument("--gpt-iters", type=int, default=6)
    args = parser.parse_args(argv)
    if args.quick:
        args.micros, args.rounds, args.t_ms, args.gpt_micros = [4, 8], 1, 20.0, []
    result = run(args)
    return report(result, table(result), args.json, quick=args.quick)


if __name__ == "__main__":
    main()
