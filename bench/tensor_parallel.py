"""Tensor parallel: hyper_adaptor's styles against torch's own ``parallelize_module`` and megatron-core's TP layers
on the same Llama shapes; TP2 on two ranks and TP2 x DP2 (HSDP levels 1-3 / torch's ``fully_shard`` /
megatron's DDP and distributed optimizer) on four. Step time, per-rank peak memory, TP and DP bytes per step
against theory, and the loss of hyper_adaptor's rows against torch's (the same weights and data).

Run from the repository root (docs/features/library.md says what each figure is)::

    python bench/tensor_parallel.py            # dim 512, 4 layers, seq 256, 2 warm-up + 6 timed steps
    python bench/tensor_parallel.py --quick    # dim 128, 2 layers, seq 64, 1 + 2 steps (smoke run)

Megatron's rows use its GPTModel (local spec: RMSNorm, SwiGLU, RoPE, GQA, no biases, untied output) with the
same shapes; its weights are its own (megatron's initialisation), so its loss is not compared, only its time,
memory and traffic. The rows of one world take their steps in turn (the order reversed every round), so load
from other work on the machine falls on all alike: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/tensor_parallel.py` puts bench/ first, not the root
    sys.path.insert(0, str(REPO_ROOT))

from bench._tp_contenders import (  # noqa: E402
    CONTENDERS,
    SEED,
    TP2,
    TP2_DP2,
    Contender,
    FuncolCounter,
    theory_dp_bytes,
    theory_megatron_sp_regather_bytes,
    theory_tp_bytes,
)
from hyper_adaptor.testing.measure import (  # noqa: E402
    SENT_BYTES,
    CollectiveCounter,
    PeakMemory,
    machine,
    machine_line,
    mib,
    report,
    run_world,
)

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "tensor_parallel.json"
PARITY_RTOL = 1e-5


def batch(step: int, dp_rank: int, dp: int, dims: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + step)
    mb = dims["micro_batch"]
    tokens = torch.randint(0, dims["vocab"], (dp * mb, dims["seq"] + 1), generator=g)[dp_rank * mb:(dp_rank + 1) * mb]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def bench_rank(rank: int, world_size: int, dims: dict, names: list[str], warmup: int, steps: int) -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from megatron.core import parallel_state as ps

    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    tp, dp = 2, world_size // 2
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    contenders = [Contender(name, dims, mesh) for name in names]
    counter, funcol = CollectiveCounter(SENT_BYTES), FuncolCounter()
    losses = {c.name: [] for c in contenders}
    times = {c.name: [] for c in contenders}
    comm = {}
    with counter, funcol:
        for r in range(warmup + steps):
            tokens, labels = batch(r, dp_rank, dp, dims)
            for c in contenders if r % 2 == 0 else contenders[::-1]:
                counting = r == warmup - 1  # a warm step: the traffic of one steady-state step
                counter.phase = funcol.phase = "step" if counting else None
                dist.barrier()
                loss, elapsed = c.timed_step(tokens, labels)
                counter.phase = funcol.phase = None
                losses[c.name].append(loss)
                if counting:
                    taken = [counter.take().get("step", {"bytes": 0, "ops": {}}),
                             funcol.take().get("step", {"bytes": 0, "ops": {}})]
                    comm[c.name] = {"bytes": sum(t["bytes"] for t in taken),
                                    "ops": {k: v for t in taken for k, v in t["ops"].items()}}
                if r >= warmup:
                    times[c.name].append(elapsed)
            if rank == 0:
                print(f"  world {world_size}: round {r + 1}/{warmup + steps} done", flush=True)
    peak = {}
    tokens, labels = batch(warmup + steps, dp_rank, dp, dims)
    for c in contenders:
        with PeakMemory() as measured:
            c.step(tokens, labels)  # seen, so that what the measured step frees is known
            start = sum(c.model_state().values()) + (c.pool_bytes() or 0)
            dist.barrier()
            measured.mark()
            c.step(tokens, labels)
        peak[c.name] = {"start_bytes": start, "rise_bytes": measured.rise}
    loss_tensor = torch.tensor([losses[c.name] for c in contenders], dtype=torch.float64)
    dist.all_reduce(loss_tensor)
    loss_tensor /= world_size
    time_tensor = torch.tensor([times[c.name] for c in contenders], dtype=torch.float64)
    dist.all_reduce(time_tensor, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    result = {
        "loss": {c.name: loss_tensor[i].tolist() for i, c in enumerate(contenders)},
        "step_s": {c.name: time_tensor[i].tolist() for i, c in enumerate(contenders)},
        "comm": comm, "peak": peak, "state": {c.name: c.model_state() for c in contenders},
        "psi_local": {c.name: c.psi_local for c in contenders},
        "psi_gathered_once": {c.name: c.psi_gathered_once for c in contenders},
    }
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return result


def rows_of(world: int, names: list[str], results: list, dims: dict) -> list[dict]:
    r0 = results[0]
    dp = world // 2
    median = {n: statistics.median(r0["step_s"][n]) for n in names}
    peaks = {n: max(res["peak"][n]["start_bytes"] + res["peak"][n]["rise_bytes"] for res in results) for n in names}
    rows = []
    for name in names:
        spec = CONTENDERS[name]
        twin = name.replace("hyper-", "torch-").replace("-hsdp-level1", "-fsdp2").replace(
            "-hsdp-level2", "-fsdp2").replace("-hsdp-level3", "-fsdp2")
        anchor_time = twin if twin in median and twin != name else None
        tp_theory = theory_tp_bytes(dims, 2, dims["micro_batch"], gathered_logits=spec.tp != "megatron")
        if spec.tp == "megatron" and spec.sequence_parallel:
            tp_theory += theory_megatron_sp_regather_bytes(dims, 2, dims["micro_batch"])
        dp_theory = theory_dp_bytes(spec.dp, r0["psi_local"][name], dp, r0["psi_gathered_once"][name])
        comm = max(res["comm"][name]["bytes"] for res in results)
        loss = r0["loss"][name]
        ref = r0["loss"].get(twin) if spec.tp == "hyper" and twin != name else None
        rows.append({
            "contender": name, "world": world, "tp": spec.tp, "dp": spec.dp,
            "sequence_parallel": spec.sequence_parallel,
            "loss": loss, "loss_vs_torch_max_rel_diff": (
                None if ref is None else max(abs(a - b) / abs(b) for a, b in zip(loss, ref))),
            "step_ms_median": median[name] * 1000,
            "step_vs_torch": None if anchor_time is None else median[name] / median[anchor_time],
            "peak_bytes_max": peaks[name],
            "peak_vs_torch": None if anchor_time is None else peaks[name] / peaks[anchor_time],
            "state_bytes_rank0": r0["state"][name],
            "comm_bytes_max": comm, "comm_ops_rank0": r0["comm"][name]["ops"],
            "comm_theory_bytes": tp_theory + dp_theory, "tp_theory_bytes": tp_theory, "dp_theory_bytes": dp_theory,
            "comm_vs_theory": comm / (tp_theory + dp_theory),
            "psi_local": r0["psi_local"][name], "psi_gathered_once": r0["psi_gathered_once"][name],
        })
    return rows


def run(args) -> dict:
    dims = dict(dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn,
                vocab=args.vocab, seq=args.seq, micro_batch=args.micro_batch)
    load_before = os.getloadavg()
    rows = []
    for world, specs in ((2, TP2), (4, TP2_DP2)):
        names = [s.name for s in specs if not args.contenders or s.name in args.contenders.split(",")]
        if not names:
            continue
        results = run_world(world, "bench.tensor_parallel:bench_rank", timeout=args.timeout, dims=dims, names=names,
                            warmup=args.warmup, steps=args.steps)
        rows += rows_of(world, names, results, dims)
    return {
        "benchmark": "tensor_parallel", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "dtype": "fp32", "optimizer": "AdamW lr 1e-3, no weight decay (megatron: its Adam, the same update)",
        "model": dict(dims, spec="hyper_adaptor.testing.llama (RMSNorm, RoPE, SwiGLU, GQA, untied output)"),
        "warmup": args.warmup, "steps": args.steps,
        "machine": machine(torch_threads=1, load_average_1min_before_after=[load_before[0], os.getloadavg()[0]]),
        "rows": rows,
    }


def table(result: dict) -> str:
    head = ("contender", "ranks", "loss rel. diff vs torch", "step ms (vs torch)", "peak MiB (vs torch)",
            "TP+DP bytes/step MiB (theory, ratio)")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in result["rows"]:
        diff = "-" if r["loss_vs_torch_max_rel_diff"] is None else f"{r['loss_vs_torch_max_rel_diff']:.1e}"
        vs_t = "" if r["step_vs_torch"] is None else f" ({r['step_vs_torch']:.2f}x)"
        vs_p = "" if r["peak_vs_torch"] is None else f" ({r['peak_vs_torch']:.2f}x)"
        lines.append(" | ".join((
            r["contender"], str(r["world"]), diff, f"{r['step_ms_median']:.0f}{vs_t}",
            f"{mib(r['peak_bytes_max'])}{vs_p}",
            f"{mib(r['comm_bytes_max'])} ({mib(r['comm_theory_bytes'])}, {r['comm_vs_theory']:.2f})")))
    lines.append("")
    lines.append(f"Model: {result['model']}; {result['warmup']} warm-up + {result['steps']} timed steps per row.")
    lines.append(machine_line(result))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per data-parallel rank per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--contenders", default="", help="comma-separated subset of rows (default: all): "
                        + ", ".join(CONTENDERS))
    parser.add_argument("--quick", action="store_true", help="dim 128, 2 layers, seq 64, 2 warm-up + 2 steps")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.ffn, args.vocab, args.seq, args.warmup, args.steps = 128, 2, 352, 1024, 64, 2, 2
    start = datetime.datetime.now()
    result = run(args)
    result["wall_s"] = (datetime.datetime.now() - start).total_seconds()
    return report(result, table(result), args.json, quick=args.quick)


if __name__ == "__main__":
    main()
