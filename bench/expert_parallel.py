"""Expert parallel on one 4-rank gloo world: megatron's MoE layer with megatron's allgather and all-to-all
token dispatchers against hyper_adaptor's engine (``--moe-dispatcher-engine hyper``), side by side in one
run — step time, tokens/s and all-to-all bytes against theory — then the engine's overlap (exposed
communication with and without it), hot-expert replicas on a Zipf-skewed router (max/mean tokens per
rank) and peak memory per rank of EP + HSDP level 3 against EP + megatron's distributed optimizer.

Run from the repository root (docs/features/expert-parallel.md says what each figure is and why)::

    python bench/expert_parallel.py            # the full run
    python bench/expert_parallel.py --quick    # small layer, few steps (smoke run)
    python bench/expert_parallel.py --one-device [--dtype bf16]   # one layer on this machine's one accelerator
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import _moe_layer, _moe_memory, _moe_one_device  # noqa: E402
from hyper_adaptor.testing.measure import (  # noqa: E402
    SENT_BYTES,
    CollectiveCounter,
    add_preset_options,
    machine,
    machine_line,
    preset,
    report,
    run_world,
    target_lines,
)

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "expert_parallel.json"
ONE_DEVICE_JSON = REPO_ROOT / "bench" / "results" / "expert_parallel_one_device.json"
WORLD = 4
EP = 4
DEFAULTS = {"steps": 3, "rounds": 5, "warmup": 1}
QUICK = {"steps": 1, "rounds": 1, "warmup": 1}
DISPATCHERS = {  # name -> (dispatcher, engine chunks)
    "megatron-allgather": ("allgather", 1),
    "megatron-alltoall": ("alltoall", 1),
    "engine": ("engine", 1),
    "engine-chunks2": ("engine", 2),
}
PARITY_RTOL = 1e-5


def dispatcher_rank(rank: int, world_size: int, d: dict, names: list[str], steps: int, rounds: int,
                    warmup: int) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    x, probe = _moe_layer.inputs(d, rank)
    layers = {name: _moe_layer.build(d, EP, *DISPATCHERS[name]) for name in names
              if DISPATCHERS[name][0] != "engine"}
    if any(DISPATCHERS[name][0] == "engine" for name in names):
        # megatron's layers built above keep their dispatcher; the routed-experts wrap hands them to
        # megatron's own method
        _moe_layer.install_engine()
        layers.update({name: _moe_layer.build(d, EP, *DISPATCHERS[name]) for name in names
                       if DISPATCHERS[name][0] == "engine"})
    layers = {name: layers[name] for name in names}
    # megatron's parallel state is global: every layer here was built under the same EP layout
    out = {name: {"times": [], "bytes": None, "loss": None} for name in names}
    for name, layer in layers.items():
        for _ in range(warmup):
            layer.zero_grad()
            out[name]["loss"] = _moe_layer.step(layer, x, probe)
    with CollectiveCounter(SENT_BYTES) as counter:
        for name, layer in layers.items():
            counter.phase = name
            layer.zero_grad()
            _moe_layer.step(layer, x, probe)
            counter.phase = None
        counted = counter.take()
    for name in names:
        out[name]["bytes"] = counted.get(name, {"bytes": 0, "ops": {}})
    for _ in range(rounds):  # interleaved, so that load on the machine hits every contender alike
        for name, layer in layers.items():
            dist.barrier()
            for _ in range(steps):
                layer.zero_grad()
                start = time.perf_counter()
                _moe_layer.step(layer, x, probe)
                out[name]["times"].append(time.perf_counter() - start)
    routed = _moe_layer.routed_rows(layers[names[0]], x, EP)
    grads = {name: torch.cat([p.grad.reshape(-1) for p in layer.parameters() if p.grad is not None])
             for name, layer in layers.items()}
    reference = grads.get("megatron-alltoall")
    for name in names:
        if reference is not None:  # relative to the largest gradient entry (sums in another order)
            out[name]["grad_max_diff"] = float((grads[name] - reference).abs().max() / reference.abs().max())
    return {"routed": routed, "contenders": out, "tokens": d["seq"] * d["micro"]}


def engine_theory_bytes(routed: dict, hidden: int, experts: int, ep: int, elem: int = 4) -> int:
    """Bytes one rank sends in one step through the engine: forward dispatch sends its off-rank rows and
    the forward combine returns the rows it received; backward mirrors both; plus the count exchange
    (E int64 counts, the off-rank share)."""
    rows = routed["sent_rows"] + routed["received_rows"]
    return 2 * rows * hidden * elem + experts * 8 * (ep - 1) // ep


def overlap_rank(rank: int, world_size: int, tokens: int = 4096, hidden: int = 256, ffn: int = 512,
                 experts: int = 8, topk: int = 2, chunks=(2, 4), steps: int = 5, shared: bool = True) -> list:
    """Exposed communication with and without overlap (``measure_exposed_comm``) on the engine's experts
    (``GroupedExperts``, SwiGLU, E / P per rank) and a ``FeedForward`` shared expert, softmax top-k routing
    of ``tokens`` random tokens per rank."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hyper_adaptor.parallel.expert import FeedForward, GroupedExperts, measure_exposed_comm

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    group = dist.group.WORLD
    torch.manual_seed(0)
    local = GroupedExperts(experts // world_size, hidden, ffn)
    shared_fn = FeedForward(hidden, ffn) if shared else None
    router = torch.randn(hidden, experts)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank + 1)).requires_grad_()
    scores = torch.softmax(x.detach() @ router, dim=-1)
    top = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
    rows = measure_exposed_comm(x, routing_map, scores * routing_map, local, ep_group=group, chunks=tuple(chunks),
                                shared_fn=shared_fn, steps=steps)
    dist.barrier()
    return rows


def overlap_rows(quick: bool, timeout: float) -> list[dict]:
    """Exposed communication with and without the engine's overlap (``measure_exposed_comm``: the modes
    in turns, step by step) on the engine's grouped SwiGLU experts and a shared expert, per rank."""
    tokens, steps = (512, 2) if quick else (4096, 5)
    ranks = run_world(WORLD, "bench.expert_parallel:overlap_rank", timeout=timeout, tokens=tokens,
                      chunks=(1, 2, 4), steps=steps)
    rows = []
    for i, mode in enumerate(ranks[0]):
        per_rank = [r[i] for r in ranks]
        rows.append({"mode": mode["mode"], "chunks": mode["chunks"], "tokens_per_rank": tokens,
                     "step_s": [r["step_s"] for r in per_rank],
                     "exposed_comm_s": [r["exposed_comm_s"] for r in per_rank]})
    return rows


def replica_rows(quick: bool) -> list[dict]:
    """max / mean rows per EP rank on a Zipf-skewed router, 4 ranks, 8 experts top-2, 0-4 replicas (the
    plan from 4 steps of counts, measured on the next 4 steps of fresh tokens)."""
    from hyper_adaptor.parallel.expert import skewed_load_report

    tokens = 512 if quick else 4096
    rows = []
    for exponent in (1.0, 1.5):
        for replicas in (0, 1, 2, 3, 4):
            r = skewed_load_report(num_ranks=WORLD, num_experts=8, topk=2, replicas=replicas, exponent=exponent,
                                   tokens_per_rank=tokens)
            rows.append({"exponent": exponent, "replicas": replicas, **r})
    return rows


def run(args) -> dict:
    p = preset(args, DEFAULTS, QUICK)
    d = _moe_layer.dims(args.quick)
    load_before = os.getloadavg()[0]
    start = time.time()
    names = list(DISPATCHERS)
    ranks = run_world(WORLD, "bench.expert_parallel:dispatcher_rank", timeout=args.timeout, d=d, names=names,
                      **p)
    rows, targets = {}, []
    engine_median = megatron_median = None
    for name in names:
        per_rank = [r["contenders"][name] for r in ranks]
        step = statistics.median([statistics.median(c["times"]) for c in per_rank])
        sent = [c["bytes"]["bytes"] for c in per_rank]
        row = {"step_ms": 1e3 * step, "tokens_per_s": WORLD * ranks[0]["tokens"] / step,
               "bytes_per_rank": sent, "ops": per_rank[0]["bytes"]["ops"],
               "loss": [c["loss"] for c in per_rank],
               "grad_max_diff_vs_megatron_alltoall": max(c.get("grad_max_diff", 0.0) for c in per_rank)}
        if name.startswith("engine"):
            theory = [engine_theory_bytes(r["routed"], d["hidden"], d["experts"], EP) for r in ranks]
            row["theory_bytes_per_rank"] = theory
            worst = max(abs(s - t) / t for s, t in zip(sent, theory, strict=True))
            targets.append({"target": "engine all-to-all bytes = theory within 2 %", "where": f"{name}, worst rank",
                            "value": worst, "met": worst <= 0.02})
        if name == "engine":
            engine_median = step
        if name == "megatron-alltoall":
            megatron_median = step
        rows[name] = row
    if engine_median and megatron_median:
        ratio = engine_median / megatron_median
        targets.append({"target": "engine step time <= megatron's all-to-all dispatcher", "where": "median ratio",
                        "value": ratio, "met": ratio <= 1.0})
    worst_grad = max(r["grad_max_diff_vs_megatron_alltoall"] for r in rows.values())
    targets.append({"target": f"gradients equal megatron's all-to-all within {PARITY_RTOL} (relative)",
                    "where": "every contender", "value": worst_grad, "met": worst_grad <= PARITY_RTOL})
    overlap = overlap_rows(args.quick, args.timeout)
    plain = next(r for r in overlap if r["mode"] == "plain")
    for row in overlap:
        row["exposed_vs_plain"] = statistics.median(row["exposed_comm_s"]) / statistics.median(plain["exposed_comm_s"])
    replicas = replica_rows(args.quick)
    for row in replicas:
        if row["replicas"] == max(r["replicas"] for r in replicas):
            targets.append({"target": "replicas: max/mean tokens per rank <= 1.1 on the Zipf router",
                            "where": f"exponent {row['exponent']}, {row['replicas']} replicas",
                            "value": row["max_over_mean_after"], "met": row["max_over_mean_after"] <= 1.1})
    memory = _moe_memory.summarize(run_world(WORLD, "bench._moe_memory:memory_rank", timeout=args.timeout,
                                             quick=args.quick))
    ratio = memory["hsdp_level3_peak_vs_distopt"]
    targets.append({"target": "EP + HSDP level 3 peak below EP + distributed optimizer", "where": "max rank, ratio",
                    "value": ratio, "met": ratio < 1.0})
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/expert_parallel.py", *sys.argv[1:]]),
        "machine": machine(world=WORLD, load_average_1min_before_after=[load_before, os.getloadavg()[0]]),
        "wall_s": time.time() - start, "dims": d, "preset": p, "ep": EP, "dispatchers": rows,
        "overlap": overlap, "replicas": replicas, "memory": memory, "targets": targets,
    }


def table(result: dict) -> str:
    d = result["dims"]
    lines = [f"MoE layer: {d['experts']} experts top-{d['topk']}, hidden {d['hidden']}, expert FFN {d['ffn']} "
             f"(SwiGLU), {d['seq'] * d['micro']} tokens per rank, EP {result['ep']} on {WORLD} gloo ranks, fp32.",
             "", f"{'dispatcher':<22}{'step ms':>10}{'tokens/s':>11}{'sent MiB/rank':>15}{'theory MiB':>12}"
             f"{'grad diff':>11}"]
    for name, row in result["dispatchers"].items():
        sent = statistics.mean(row["bytes_per_rank"]) / 2**20
        theory = row.get("theory_bytes_per_rank")
        theory_text = f"{statistics.mean(theory) / 2**20:.3f}" if theory else "-"
        lines.append(f"{name:<22}{row['step_ms']:>10.1f}{row['tokens_per_s']:>11.0f}{sent:>15.3f}{theory_text:>12}"
                     f"{row['grad_max_diff_vs_megatron_alltoall']:>11.1e}")
    tokens = result["overlap"][0]["tokens_per_rank"]
    lines += ["", f"Overlap ({tokens} tokens per rank, engine's grouped SwiGLU experts and a shared expert; "
              "medians over steps, range over ranks):",
              f"{'mode':<10}{'chunks':>7}{'step s':>16}{'exposed comm s':>18}{'exposed / plain':>17}"]
    for row in result["overlap"]:
        lines.append(f"{row['mode']:<10}{row['chunks']:>7}{_span(row['step_s']):>16}"
                     f"{_span(row['exposed_comm_s']):>18}{row['exposed_vs_plain']:>17.2f}")
    lines += ["", "Hot-expert replicas (Zipf-skewed router, 4 ranks, 8 experts top-2; rows per rank max/mean):",
              f"{'zipf exponent':<15}{'replicas':>9}{'before':>8}{'after':>8}"]
    for row in result["replicas"]:
        lines.append(f"{row['exponent']:<15}{row['replicas']:>9}{row['max_over_mean_before']:>8.3f}"
                     f"{row['max_over_mean_after']:>8.3f}")
    lines += ["", "Peak memory per rank, GPT-MoE at EP 2 on 4 ranks (each step as megatron.training takes it):",
              _moe_memory.table(result["memory"])]
    lines += ["", "Targets:", *target_lines(result["targets"]), "", machine_line(result)]
    return "\n".join(lines)


def _span(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_preset_options(parser, DEFAULTS, QUICK)
    parser.add_argument("--json", default=None, help=f"default {DEFAULT_JSON} ({ONE_DEVICE_JSON} with --one-device)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--one-device", action="store_true",
                        help="one MoE layer on this process's one device (a GPU, an NPU or the CPU), expert parallel 1")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="with --one-device")
    args = parser.parse_args(argv)
    if args.one_device:
        timing = preset(args, {"steps": 20, "rounds": 1, "warmup": 3}, {"steps": 2, "rounds": 1, "warmup": 1})
        start, load_before = time.perf_counter(), os.getloadavg()[0]
        result = _moe_one_device.run(args.quick, timing["steps"], timing["warmup"], args.dtype)
        result.update(machine=machine(load_average_1min_before_after=[load_before, os.getloadavg()[0]]),
                      wall_s=time.perf_counter() - start)
        return report(result, _moe_one_device.table(result) + "\n" + machine_line(result),
                      args.json or ONE_DEVICE_JSON, args.quick)
    result = run(args)
    return report(result, table(result), args.json or DEFAULT_JSON, args.quick)


if __name__ == "__main__":
    main()
