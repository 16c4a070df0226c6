"""HSDP against Megatron DDP, Megatron's distributed optimizer and torch FSDP2 on one 4-rank gloo world:
parity, model state and communication per rank against the ZeRO theory, step time and step peak memory.

Run from the repository root (docs/features/hsdp.md says what each figure is and why)::

    python bench/hsdp.py            # 18 contenders, 33 interleaved rounds
    python bench/hsdp.py --quick    # smaller model, 2 warm-up + 3 steps (smoke run)
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench._hsdp_contenders import (  # noqa: E402
    ANCHORS,
    CONTENDERS,
    DEFAULT_BUCKET_KB,
    LR,
    Contender,
    batch,
    configured_theory,
    make_gpt,
    theory_comm_bytes,
    theory_state_bytes,
)
from hyper_adaptor.testing.measure import (  # noqa: E402
    BUFFER_BYTES,
    CollectiveCounter,
    PeakMemory,
    machine,
    mib,
    report,
    run_world,
)

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "hsdp.json"
WORLD = 4
PARITY_RTOL = 1e-5
PEAK_REPEATS = 2


def bench_rank(rank: int, world_size: int, dims: dict, names: list[str], warmup: int, steps: int,
               bucket_kb: float = DEFAULT_BUCKET_KB) -> dict:
    import warnings

    from megatron.core import parallel_state as ps

    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated c10d aliases megatron calls
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ps.initialize_model_parallel(1, 1)
    _, reference = make_gpt(dims, None)
    init = {k: v.detach().clone() for k, v in reference.named_parameters()}
    psi = sum(p.numel() for p in reference.parameters())  # tied embedding counted once
    del reference

    contenders = [Contender(name, dims, init, bucket_kb) for name in names]
    counter = CollectiveCounter(BUFFER_BYTES)
    comm_step = warmup - 1 if warmup >= 2 else 0  # steady state: level 1/2 re-gather after an update
    losses = {c.name: [] for c in contenders}
    times = {c.name: [] for c in contenders}
    phases = {c.name: [] for c in contenders}
    comm, hsdp_comm, grad_norm = {}, {}, {}
    with counter:
        for r in range(warmup + steps):
            order = contenders if r % 2 == 0 else contenders[::-1]
            data = batch(r, rank, world_size, dims)
            for c in order:
                counting = r == comm_step
                before = c.hsdp_comm_bytes()
                dist.barrier()
                counter.phase = "step" if counting else None
                start = time.perf_counter()
                loss, backward_s, optimizer_s = c.step(data)
                elapsed = time.perf_counter() - start
                losses[c.name].append(loss)
                counter.phase = None
                if counting:
                    comm[c.name] = counter.take()["step"]
                    if before is not None:
                        hsdp_comm[c.name] = c.hsdp_comm_bytes() - before
                if r == 0:
                    grad_norm[c.name] = c.grad_norm()
                if r >= warmup:
                    times[c.name].append(elapsed)
                    phases[c.name].append((backward_s, optimizer_s))
            if rank == 0:
                print(f"  round {r + 1}/{warmup + steps} done", flush=True)
    state = {c.name: c.model_state() for c in contenders}
    pool = {c.name: c.pool_bytes() for c in contenders}
    activation_rise, peak = measure_peaks(contenders, batch(warmup + steps, rank, world_size, dims), dims, init)

    # the loss of the global batch (mean over ranks) and the slowest rank's time per step
    loss_tensor = torch.tensor([losses[c.name] for c in contenders], dtype=torch.float64)
    dist.all_reduce(loss_tensor)
    loss_tensor /= world_size
    time_tensor = torch.tensor([times[c.name] for c in contenders], dtype=torch.float64)
    dist.all_reduce(time_tensor, op=dist.ReduceOp.MAX)
    layout = {c.name: c.layout() for c in contenders}
    ps.destroy_model_parallel()
    return {
        "psi": psi,
        "loss": {c.name: loss_tensor[i].tolist() for i, c in enumerate(contenders)},
        "step_s": {c.name: time_tensor[i].tolist() for i, c in enumerate(contenders)},
        "phase_s": {c.name: phases[c.name] for c in contenders},
        "grad_norm": grad_norm,
        "layout": layout,
        "state": state,
        "pool_bytes": pool,
        "comm": comm,
        "hsdp_comm_bytes": hsdp_comm,
        "comm_step": comm_step,
        "activation_rise": activation_rise,
        "peak": peak,
    }


def measure_peaks(contenders: list, data: dict, dims: dict, init: dict) -> tuple[int, dict]:
    """Per contender, two more steps (after the timed ones), the second measured from the bytes live at
    its start; ``PEAK_REPEATS`` times, the highest kept. Also once: the rise of forward + backward of the
    plain model, its gradients already allocated (the activations every contender pays alike)."""
    _, plain = make_gpt(dims, init)
    args = (data["tokens"], data["position_ids"], data["attention_mask"])
    with PeakMemory() as measured:
        plain(*args, labels=data["labels"]).mean().backward()  # the gradients exist from now on
        for p in plain.parameters():
            p.grad.zero_()
        measured.mark()
        plain(*args, labels=data["labels"]).mean().backward()
    activation_rise = measured.rise
    del plain
    peak = {}
    for c in contenders:
        repeats = []
        for _ in range(PEAK_REPEATS):
            with PeakMemory() as measured:
                c.step(data)  # recorded so that the sizes of what the measured step frees are known
                start = sum(c.model_state().values()) + (c.pool_bytes() or 0)
                dist.barrier()
                measured.mark()
                c.step(data)
            repeats.append((start, measured.rise))
        start, rise = max(repeats, key=sum)
        peak[c.name] = {"start_bytes": start, "rise_bytes": rise, "repeats": repeats, "bucket_bytes": c.bucket_bytes(),
                        "pool_bytes_after": c.pool_bytes(), "largest_pooled_block_after": c.largest_pooled_block()}
    return activation_rise, peak


def run(args) -> dict:
    dims = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab, seq=args.seq,
                micro_batch=args.micro_batch)
    names = list(CONTENDERS)
    if args.contenders:
        wanted = set(args.contenders.split(",")) | set(ANCHORS)
        unknown = wanted - set(names)
        if unknown:
            raise SystemExit(f"--contenders: unknown {sorted(unknown)}; known: {', '.join(names)}")
        names = [n for n in names if n in wanted]
    load_before = os.getloadavg()
    results = run_world(WORLD, "bench.hsdp:bench_rank", timeout=args.timeout, dims=dims, names=names,
                        warmup=args.warmup, steps=args.steps, bucket_kb=args.bucket_kb)
    r0 = results[0]
    psi, n = r0["psi"], WORLD
    ref_loss = r0["loss"]["megatron-ddp"]
    rows = []
    medians = {name: statistics.median(r0["step_s"][name]) for name in names}
    activation_rise = max(res["activation_rise"] for res in results)
    peaks = {name: max(res["peak"][name]["start_bytes"] + res["peak"][name]["rise_bytes"] for res in results)
             for name in names}
    for name in names:
        spec = CONTENDERS[name]
        kind, stage, threshold = spec.kind, spec.stage, spec.threshold_kb
        # per-rank figures: memory and communication from every rank (they differ by padding only)
        state = [res["state"][name] for res in results]
        total = [sum(s.values()) for s in state]
        comm = [res["comm"][name]["bytes"] for res in results]
        loss = r0["loss"][name]
        layout = r0["layout"][name]
        state_configured, comm_configured = configured_theory(stage, psi, n, **layout)
        backward_s = statistics.median(b for b, _ in r0["phase_s"][name])
        optimizer_s = statistics.median(o for _, o in r0["phase_s"][name])
        norm, ref_norm = r0["grad_norm"][name], r0["grad_norm"]["megatron-ddp"]
        rows.append({
            "contender": name, "kind": kind, "zero_stage": stage, "threshold_kb": threshold,
            "first_grad_norm": norm, "first_grad_norm_rel_diff": abs(norm - ref_norm) / abs(ref_norm),
            "first_loss": loss[0], "first_loss_rel_diff": abs(loss[0] - ref_loss[0]) / abs(ref_loss[0]),
            "last_loss": loss[-1], "last_loss_rel_diff": abs(loss[-1] - ref_loss[-1]) / abs(ref_loss[-1]),
            "parity_ok": (abs(loss[0] - ref_loss[0]) <= PARITY_RTOL * abs(ref_loss[0])
                          and abs(norm - ref_norm) <= PARITY_RTOL * abs(ref_norm)),
            "state_bytes_rank0": state[0], "state_bytes_max": max(total),
            "state_theory_bytes": theory_state_bytes(stage, psi, n),
            "state_vs_theory": max(total) / theory_state_bytes(stage, psi, n),
            "psi_whole": layout["psi_whole"], "psi_gathered_once": layout["psi_gathered_once"],
            "state_theory_configured_bytes": state_configured,
            "state_vs_configured_theory": max(total) / state_configured,
            "comm_bytes_rank0": comm[0], "comm_bytes_max": max(comm), "comm_ops_rank0": r0["comm"][name]["ops"],
            "comm_theory_bytes": theory_comm_bytes(stage, psi),
            "comm_vs_theory": max(comm) / theory_comm_bytes(stage, psi),
            "comm_theory_configured_bytes": comm_configured,
            "comm_vs_configured_theory": max(comm) / comm_configured,
            "hsdp_comm_bytes_rank0": r0["hsdp_comm_bytes"].get(name),
            "hsdp_pool_bytes_max": (None if r0["pool_bytes"][name] is None
                                    else max(res["pool_bytes"][name] for res in results)),
            # peak of a step (max over ranks) against the configured theory + activations + 2 buckets
            "peak_bytes_max": peaks[name],
            "peak_start_bytes_rank0": r0["peak"][name]["start_bytes"],
            "peak_rise_bytes_rank0": r0["peak"][name]["rise_bytes"],
            "bucket_bytes": r0["peak"][name]["bucket_bytes"],
            "activation_rise_bytes": activation_rise,
            "peak_bound_bytes": state_configured + activation_rise + 2 * r0["peak"][name]["bucket_bytes"],
            "peak_vs_bound": peaks[name] / (state_configured + activation_rise + 2 * r0["peak"][name]["bucket_bytes"]),
            "peak_vs_megatron_distopt": peaks[name] / peaks["megatron-distopt"],
            "peak_vs_fsdp2": peaks[name] / peaks["fsdp2"],
            "pool_bytes_after_peak_step_max": (None if r0["peak"][name]["pool_bytes_after"] is None
                                               else max(res["peak"][name]["pool_bytes_after"] for res in results)),
            "largest_pooled_block_after_bytes": r0["peak"][name]["largest_pooled_block_after"],
            "step_ms_median": medians[name] * 1000,
            "step_ms_all": [t * 1000 for t in r0["step_s"][name]],
            "rank0_forward_backward_ms_median": backward_s * 1000, "rank0_optimizer_ms_median": optimizer_s * 1000,
            "step_vs_megatron_distopt": medians[name] / medians["megatron-distopt"],
            "step_vs_fsdp2": medians[name] / medians["fsdp2"],
        })
    return {
        "benchmark": "hsdp", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "world": n, "dtype": "fp32", "optimizer": f"Adam lr={LR}, no weight decay, no clipping",
        "model": dict(dims, psi=psi, ffn=4 * args.hidden, spec="megatron-core GPTModel, local spec, tied embedding"),
        "warmup": args.warmup, "steps": args.steps, "comm_step": r0["comm_step"] + 1,
        "hsdp_bucket_kb": args.bucket_kb, "activation_rise_bytes": activation_rise,
        # one torch thread per rank (hyper_adaptor/testing/world.py sets OMP_NUM_THREADS=1)
        "machine": machine(torch_threads=1, ranks=WORLD,
                           load_average_1min_before_after=[load_before[0], os.getloadavg()[0]]),
        "rows": rows,
    }


def table(result: dict) -> str:
    psi, n = result["model"]["psi"], result["world"]
    head = ("contender", "ZeRO", "step-1 loss / grad norm (rel. diff vs DDP)", "params / grads / optim MiB",
            "state MiB", "x theory", "x as configured", "comm MiB", "x theory", "x as configured",
            "hsdp_comm_bytes MiB",
            "step ms (fwd+bwd / opt)", "x distopt", "x fsdp2")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        s = r["state_bytes_rank0"]
        hsdp_comm = "-" if r["hsdp_comm_bytes_rank0"] is None else mib(r["hsdp_comm_bytes_rank0"])
        threshold = "" if r["threshold_kb"] is None else f", threshold {r['threshold_kb']} KB"
        lines.append("| " + " | ".join((
            r["contender"] + threshold, r["zero_stage"],
            f"{r['first_loss']:.6f} ({r['first_loss_rel_diff']:.1e}) / {r['first_grad_norm']:.5f} "
            f"({r['first_grad_norm_rel_diff']:.1e}){'' if r['parity_ok'] else ' FAIL'}",
            f"{mib(s['params'])} / {mib(s['grads'])} / {mib(s['optim'])}", mib(r["state_bytes_max"]),
            f"{r['state_vs_theory']:.3f}", f"{r['state_vs_configured_theory']:.3f}",
            mib(r["comm_bytes_max"]), f"{r['comm_vs_theory']:.3f}", f"{r['comm_vs_configured_theory']:.3f}",
            hsdp_comm,
            f"{r['step_ms_median']:.0f} ({r['rank0_forward_backward_ms_median']:.0f} / "
            f"{r['rank0_optimizer_ms_median']:.0f})",
            f"{r['step_vs_megatron_distopt']:.2f}", f"{r['step_vs_fsdp2']:.2f}",
        )) + " |")
    whole = ", ".join(f"{w:,}" for w in sorted({r["psi_whole"] for r in result["rows"] if r["psi_whole"]}))
    once = {r["contender"]: r["psi_gathered_once"] for r in result["rows"] if r["psi_gathered_once"]}
    notes = [
        "",
        f"Ψ = {psi:,} parameters ({mib(4 * psi)} MiB fp32), N = {n}. Theory (fp32 Adam, 16 B/param), MiB: "
        f"DDP 16Ψ = {mib(16 * psi)}, ZeRO-1 8Ψ+8Ψ/N = {mib(8 * psi + 8 * psi / n)}, "
        f"ZeRO-2 4Ψ+12Ψ/N = {mib(4 * psi + 12 * psi / n)}, ZeRO-3 16Ψ/N = {mib(16 * psi / n)}; "
        f"communication 2Ψ·4 B = {mib(8 * psi)}, 3Ψ·4 B = {mib(12 * psi)} per rank per step. These are the "
        "mixed-precision forms 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N (2 B param + 2 B grad + 12 B fp32 master and "
        "moments) with 4 B param and grad and no separate master: ZeRO-1 keeps 4+4 B whole, ZeRO-2 4 B.",
        f"As configured: HSDP threshold 64 KB keeps {whole or 'no'} parameters whole (16 B each on every rank, "
        "all-reduced: 8 B); units not resharded after forward are gathered once per step, not twice "
        "(FSDP2: its root group; HSDP level 3: the root and the last layer), parameters: "
        + ", ".join(f"{name} {count:,}" for name, count in once.items()) + ".",
        f"step ms: median over {result['steps']} interleaved steps after {result['warmup']} warm-up, slowest rank; "
        f"fwd+bwd / opt: rank 0's medians of forward+backward(+gradient reduction) and optimizer.step().",
        "HSDP's CPU buffer pool (its largest transient communication buffers, kept between steps as a "
        "caching allocator would; not in the model state above), MiB per rank: " + ", ".join(
            f"{r['contender']} {mib(r['hsdp_pool_bytes_max'])}" for r in result["rows"]
            if r.get("hsdp_pool_bytes_max") is not None) + ".",
        "",
        f"Collectives per rank in step {result['comm_step']} (rank 0: calls, MiB):",
    ]
    for r in result["rows"]:
        ops = ", ".join(f"{op} {v['calls']}x {mib(v['bytes'])}" for op, v in r["comm_ops_rank0"].items())
        notes.append(f"  {r['contender']}: {ops}")
    notes += ["", peak_table(result)]
    notes.append("")
    notes.append(f"Loss at step {result['warmup'] + result['steps']} relative to DDP's: " + ", ".join(
        f"{r['contender']} {r['last_loss_rel_diff']:.1e}" for r in result["rows"]))
    return "\n".join(lines + notes)


def peak_table(result: dict) -> str:
    """Peak bytes of a step per rank: the model state and pool live at its start, the rise above it
    (allocator events), against the bound theory + activations + 2 buckets, distopt and FSDP2."""
    head = ("contender", "bucket MiB", "start MiB (state + pool)", "rise MiB", "peak MiB",
            "bound MiB (theory + act. + 2 buckets)", "x bound", "x distopt", "x fsdp2",
            "pool after MiB (largest block)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        pool = ("-" if r["pool_bytes_after_peak_step_max"] is None else
                f"{mib(r['pool_bytes_after_peak_step_max'])} ({mib(r['largest_pooled_block_after_bytes'])})")
        lines.append("| " + " | ".join((
            r["contender"], mib(r["bucket_bytes"]), mib(r["peak_start_bytes_rank0"]),
            mib(r["peak_rise_bytes_rank0"]), mib(r["peak_bytes_max"]), mib(r["peak_bound_bytes"]),
            f"{r['peak_vs_bound']:.3f}", f"{r['peak_vs_megatron_distopt']:.3f}", f"{r['peak_vs_fsdp2']:.3f}", pool,
        )) + " |")
    lines.append("")
    lines.append(
        f"Peak of one step per rank (max over ranks; start and rise: rank 0), measured after the timed steps: "
        f"bytes live at its start (model state as above + HSDP's pool) + the highest rise of allocated bytes "
        f"during it (CPU: torch's profiler memory events, summed in time order; CUDA/NPU: "
        f"max_memory_allocated). Activations (act.): forward + backward of the plain model in one process, "
        f"its gradients already allocated: {mib(result['activation_rise_bytes'])} MiB. Bound = ZeRO theory as "
        f"configured + act. + 2 x bucket; bucket: HSDP bucket_size ({result['hsdp_bucket_kb']:g} KB; the "
        f"-unbounded rows: the whole model), megatron's bucket (the whole model here), FSDP2's largest unit.")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--bucket-kb", type=float, default=DEFAULT_BUCKET_KB,
                        help="HSDP bucket_size of every hsdp row but the -unbounded ones (KB)")
    parser.add_argument("--contenders", default="",
                        help="comma-separated subset of rows (megatron-ddp, megatron-distopt, fsdp2 always run)")
    parser.add_argument("--quick", action="store_true", help="hidden 128, 2 layers, seq 64, 2 warm-up + 3 steps")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.seq, args.warmup, args.steps = 128, 2, 64, 2, 3
    result = run(args)
    return report(result, table(result), args.json, quick=args.quick)


if __name__ == "__main__":
    main()
