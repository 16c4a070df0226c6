"""Context parallel: per-rank activation memory, communication and step time of one transformer layer
at CP 1, 2 and 4 for each algorithm on a 4-rank gloo world, against the theory, and the longest
sequence that fits one per-process memory budget.

Run from the repository root (docs/features/context-parallel.md says what each figure is and why)::

    python bench/context_parallel.py            # sequences 1024, 2048, 4096; 13 timed rounds
    python bench/context_parallel.py --quick    # sequences 256, 512, one timed round (smoke run)
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench._cp_analysis import (  # noqa: E402
    HYBRID_ULYSSES,
    WORLD,
    linear_guess,
    longest_sequence,
    merge,
    table,
    targets,
)
from hyper_adaptor.testing.measure import (  # noqa: E402
    SENT_BYTES,
    CollectiveCounter,
    StorageTracker,
    machine,
    nbytes,
    report,
    run_world,
)

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "context_parallel.json"
CP_SIZES = (1, 2, 4)
ALGORITHMS = ("ulysses", "ring", "allgather", "hybrid")
SEED = 1234
GRANULE = 64  # sequence lengths searched in steps of this (divisible by 2N for the load-balanced layout)


def contenders(n: int, algos) -> list[str]:
    """What runs at CP n: plain attention at 1; hybrid needs 1 < U < N, so CP 4 only."""
    if n == 1:
        return ["attention"]
    return [a for a in algos if a != "hybrid" or n > HYBRID_ULYSSES]


def profiler_peak(prof) -> int:
    """Peak of (bytes allocated - bytes freed) from the profiler's allocator events in time order.

    Read from the raw (kineto) events, the only place that keeps each allocation and free apart with
    its time (``prof.events()`` folds them into the running op, so an op's scratch nets to zero)."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    total = peak = 0
    for e in events:
        total += e.nbytes()
        peak = max(peak, total)
    return peak


def measure(fn, with_profiler: bool = False,
            tracker: StorageTracker | None = None) -> tuple[StorageTracker, int | None]:
    """Run ``fn()`` under the storage tracker (and the profiler, as a cross-check): (tracker, profiler's
    peak or None)."""
    tracker = StorageTracker() if tracker is None else tracker
    if not with_profiler:
        with tracker:
            fn()
        return tracker, None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, tracker:
        fn()
    return tracker, profiler_peak(prof)


def make_params(dims: dict) -> dict:
    g = torch.Generator().manual_seed(SEED)
    h, nh, ng, hn, ffn = dims["hidden"], dims["heads"], dims["kv_heads"], dims["head_dim"], dims["ffn"]
    shapes = {"qkv": (h, (nh + 2 * ng) * hn), "proj": (nh * hn, h), "fc1": (h, ffn), "fc2": (ffn, h)}
    # 1/sqrt(fan_in) keeps activations of order one, so the softmax is not degenerate
    return {name: (torch.randn(shape, generator=g) / math.sqrt(shape[0])).requires_grad_()
            for name, shape in shapes.items()}


def layer_forward(p: dict, x: torch.Tensor, core, dims: dict) -> torch.Tensor:
    nh, ng, hn = dims["heads"], dims["kv_heads"], dims["head_dim"]
    q, k, v = (x @ p["qkv"]).split([nh * hn, ng * hn, ng * hn], dim=-1)
    out = core(q.unflatten(-1, (nh, hn)), k.unflatten(-1, (ng, hn)), v.unflatten(-1, (ng, hn)))
    y = x + out.flatten(2) @ p["proj"]
    return y + F.gelu(y @ p["fc1"]) @ p["fc2"]


def shard(full: torch.Tensor, r: int, n: int) -> torch.Tensor:
    """Rank r's rows of a [S, ...] tensor in the load-balanced layout (chunks r and 2n-1-r of 2n)."""
    if n == 1:
        return full.clone()
    chunks = full.chunk(2 * n)
    return torch.cat([chunks[r], chunks[2 * n - 1 - r]])


def global_data(seq: int, dims: dict):
    g = torch.Generator().manual_seed(SEED + seq)
    shape = (seq, dims["batch"], dims["hidden"])
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


class Rank:
    """This rank's groups, layer and counters."""

    def __init__(self, rank: int, dims: dict, algos):
        from hyper_adaptor.parallel.context import build_cp_groups

        self.rank, self.dims, self.algos = rank, dims, algos
        self.params = make_params(dims)
        self.groups = {}  # n -> {"cp": CPGroups, "hybrid": CPGroups | None}
        for n in CP_SIZES:
            lists = [list(range(i, i + n)) for i in range(0, WORLD, n)]
            cp = build_cp_groups(lists, ulysses_degree=None)
            hybrid = None
            if n > HYBRID_ULYSSES and "hybrid" in algos:
                hybrid = build_cp_groups(lists, ulysses_degree=HYBRID_ULYSSES, cp_group=cp.cp)
            self.groups[n] = {"cp": cp, "hybrid": hybrid}
        self.counter = CollectiveCounter(SENT_BYTES)
        self.ring_stats = None

    def position(self, n: int) -> int:
        return self.groups[n]["cp"].cp.rank()

    def core(self, n: int, name: str):
        from hyper_adaptor.ops.attention import attention
        from hyper_adaptor.parallel.context import RingStats, context_parallel_attention

        if name == "attention":
            return lambda q, k, v: attention(q, k, v, causal=True).unflatten(2, q.shape[2:])
        groups = self.groups[n]["hybrid" if name == "hybrid" else "cp"]

        def cp_attention(q, k, v):
            extra = {}
            if name in ("ring", "hybrid"):
                self.ring_stats = extra["stats"] = RingStats()
            return context_parallel_attention(q, k, v, groups=groups, algo=name, causal=True,
                                              load_balanced=True, **extra)

        return cp_attention

    def inputs(self, seq: int, n: int):
        x_full, dz_full = global_data(seq, self.dims)
        r = self.position(n)
        return shard(x_full, r, n).requires_grad_(), shard(dz_full, r, n)

    def reset(self, x) -> None:
        """Drop the last step's gradients, outside any measured window: the profiler (the cross-check)
        cannot report the free of a block allocated before it started (it does not know its size), so a
        free inside the window would be missed and its running total overstated."""
        for p in self.params.values():
            p.grad = None
        x.grad = None

    def layer_step(self, x, dz, core, count: bool = False) -> None:
        self.counter.phase = "forward" if count else None
        z = layer_forward(self.params, x, core, self.dims)
        self.counter.phase = "backward" if count else None
        z.backward(dz)
        self.counter.phase = None

    def static_bytes(self, x, dz) -> int:
        return sum(nbytes(p) for p in self.params.values()) + nbytes(x) + nbytes(dz)

    def per_process(self, seq: int, n: int, name: str) -> int:
        """Parameters + x + dz + the layer step's peak, max over the ranks (all ranks agree on it)."""
        x, dz = self.inputs(seq, n)
        core = self.core(n, name)
        self.reset(x)
        mine = self.static_bytes(x, dz) + measure(lambda: self.layer_step(x, dz, core))[0].peak
        return int(max_over_ranks([mine])[0])

    def attention_memory(self, seq: int, n: int, name: str) -> dict:
        """The core attention alone, forward + backward on this rank's shard: its inputs (q, k, v and the
        output gradient, which a layer holds for attention at every CP size; q, k, v are saved for its
        backward), the tracker's peak and what it holds, what forward leaves alive, the profiler's peak."""
        d = self.dims
        s, b = seq // n, d["batch"]
        g = torch.Generator().manual_seed(SEED + 1)
        q = torch.randn(s, b, d["heads"], d["head_dim"], generator=g).requires_grad_()
        k, v = (torch.randn(s, b, d["kv_heads"], d["head_dim"], generator=g).requires_grad_() for _ in range(2))
        dout = torch.randn(q.shape, generator=g)
        core = self.core(n, name)
        tracker, after_forward = StorageTracker(), []

        def step():
            out = core(q, k, v)
            after_forward.append(tracker.live)  # what forward leaves for backward, and its output
            out.backward(dout)

        tracker, profiler = measure(step, with_profiler=True, tracker=tracker)
        return {"attention_inputs": nbytes([q, k, v, dout]), "attention_peak": tracker.peak,
                "attention_after_forward": after_forward[0],
                "attention_peak_profiler": profiler, "attention_peak_by_op": tracker.peak_by_op()}

    def parity(self, seq: int, n: int, name: str, reference: dict) -> dict:
        x, dz = self.inputs(seq, n)
        for p in self.params.values():
            p.grad = None
        z = layer_forward(self.params, x, self.core(n, name), self.dims)
        z.backward(dz)
        r, cp = self.position(n), self.groups[n]["cp"].cp

        def rel(a, b):
            return float((a - b).abs().max() / b.abs().max())

        errors = {"z": rel(z.detach(), shard(reference["z"], r, n)), "dx": rel(x.grad, shard(reference["dx"], r, n))}
        for key, p in self.params.items():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=cp)  # each rank has its rows' share of the weight gradient
            errors[f"d{key}"] = rel(grad, reference[f"d{key}"])
        return errors

    def reference(self, seq: int) -> dict:
        x_full, dz_full = global_data(seq, self.dims)
        x_full.requires_grad_()
        for p in self.params.values():
            p.grad = None
        z = layer_forward(self.params, x_full, self.core(1, "attention"), self.dims)
        z.backward(dz_full)
        out = {"z": z.detach(), "dx": x_full.grad}
        out.update({f"d{k}": p.grad.clone() for k, p in self.params.items()})
        return out


def max_over_ranks(values) -> list:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def bench_rank(rank: int, world_size: int, dims: dict, seqs: list, algos: list, warmup: int, rounds: int,
               budget: int, search: bool) -> dict:
    import warnings

    # megatron's import-time notices (no TE / apex) and torch 2.13's deprecation of the c10d names the
    # engines call (all_gather_into_tensor, reduce_scatter_tensor): not this benchmark's figures
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    me = Rank(rank, dims, algos)
    rows = []
    with me.counter:
        for seq in seqs:
            reference = me.reference(seq) if seq == seqs[0] else None
            for n in CP_SIZES:
                names = contenders(n, algos)
                cores = {name: me.core(n, name) for name in names}
                x, dz = me.inputs(seq, n)
                found = {name: {"seq": seq, "cp": n, "algorithm": name} for name in names}
                for name in names:
                    row = found[name]
                    if reference is not None:
                        row["parity"] = me.parity(seq, n, name, reference)
                    for _ in range(warmup):
                        me.reset(x)
                        me.layer_step(x, dz, cores[name])
                    dist.barrier()
                    me.ring_stats = None
                    me.reset(x)
                    tracker, row["layer_peak_profiler"] = measure(
                        lambda: me.layer_step(x, dz, cores[name], count=True), with_profiler=True)
                    row["layer_peak"] = tracker.peak
                    # weight gradients are not activations (and do not shrink with CP)
                    row["layer_activation_peak"] = tracker.peak_without([p.grad for p in me.params.values()])
                    row["layer_peak_by_op"] = tracker.peak_by_op()
                    row["comm"] = me.counter.take()
                    row["ring_stats_bytes_sent"] = None if me.ring_stats is None else me.ring_stats.bytes_sent
                    row["static"] = me.static_bytes(x, dz)
                    dist.barrier()
                    row.update(me.attention_memory(seq, n, name))
                times = {name: [] for name in names}
                for r in range(rounds):
                    for name in names if r % 2 == 0 else names[::-1]:
                        me.reset(x)
                        dist.barrier()
                        start = time.perf_counter()
                        me.layer_step(x, dz, cores[name])
                        times[name].append(time.perf_counter() - start)
                slowest = max_over_ranks([times[name] for name in names]) if rounds else [[] for _ in names]
                for name, ts in zip(names, slowest):
                    found[name]["step_s"] = ts
                rows.extend(found.values())
                if rank == 0:
                    print(f"  seq {seq} CP {n}: {', '.join(names)} done", flush=True)
        longest = []
        if search:
            for n in (1, CP_SIZES[-1]):
                for name in contenders(n, algos):
                    # the sweep's per-process figures (max over ranks), for the first probe
                    points = {}
                    for row in rows:
                        if row["cp"] == n and row["algorithm"] == name:
                            points[row["seq"]] = row["static"] + row["layer_peak"]
                    points = dict(zip(points, max_over_ranks(list(points.values()))))
                    guess = linear_guess(points, budget)
                    start = time.perf_counter()
                    result = longest_sequence(lambda s: me.per_process(s, n, name), budget, guess, GRANULE)
                    result.update(cp=n, algorithm=name, first_guess=guess, seconds=time.perf_counter() - start)
                    longest.append(result)
                    if rank == 0:
                        print(f"  longest sequence CP {n} {name}: {result['seq']} "
                              f"({len(result['probes'])} probes)", flush=True)
    return {"rows": rows, "longest": longest}


def run(args) -> dict:
    dims = dict(hidden=args.heads * args.head_dim, heads=args.heads, kv_heads=args.kv_heads,
                head_dim=args.head_dim, ffn=4 * args.heads * args.head_dim, batch=args.batch)
    seqs = args.seqs
    for seq in seqs:
        if seq % (2 * WORLD):
            raise SystemExit(f"--seqs: every length must be divisible by {2 * WORLD} (2 x CP 4), got {seq}")
    budget = int(args.budget_mib * 2**20)
    # kineto logs every profiler start and stop on stderr (hundreds of lines); the ranks inherit this
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    load_before = os.getloadavg()
    start = time.perf_counter()
    results = run_world(WORLD, "bench.context_parallel:bench_rank", timeout=args.timeout, dims=dims, seqs=seqs,
                        algos=args.algos, warmup=args.warmup, rounds=args.rounds, budget=budget,
                        search=not args.no_search)
    rows, longest = merge(results, dims)
    result = {
        "benchmark": "context_parallel", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python bench/context_parallel.py" + (" --quick" if args.quick else ""),
        "world": WORLD, "dtype": "fp32", "device": "cpu",
        "layer": dict(dims, causal=True, load_balanced=True, attention_backend="fast (PyTorch flash kernels)"),
        "seqs": seqs, "warmup": args.warmup, "rounds": args.rounds,
        "budget_bytes": budget, "granule": GRANULE,
        "memory_method": "storage tracker (hyper_adaptor/testing/measure.py StorageTracker, a "
                         "TorchDispatchMode): bytes of every storage an operator creates, from creation until "
                         "a finalizer sees it freed (any thread); peak of the running total over "
                         "forward+backward. Cross-check "
                         "(*_profiler_bytes): torch.profiler profile_memory=True allocator events in time order",
        "comm_method": "torch.distributed functions wrapped; bytes this rank sends in the bandwidth-optimal "
                       "schedule of each collective; point-to-point isends",
        "rows": rows, "longest": longest, "wall_s": time.perf_counter() - start,
        "machine": machine(torch_threads=1, ranks=WORLD,
                           load_average_1min_before_after=[load_before[0], os.getloadavg()[0]]),
    }
    result["targets"] = targets(rows, longest)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096],
                        help="global sequence lengths of one CP group")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4, help="GQA: fewer key/value heads (= --heads: MHA)")
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--algos", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=13, help="timed rounds (one step per algorithm each)")
    parser.add_argument("--budget-mib", type=float, default=48.0, help="per-process memory budget")
    parser.add_argument("--no-search", action="store_true", help="skip the longest-sequence search")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--quick", action="store_true", help="seqs 256 512, 1 timed round, budget 16 MiB")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    if args.quick:
        args.seqs, args.rounds, args.budget_mib = [256, 512], 1, 16.0
    result = run(args)
    return report(result, table(result), args.json, quick=args.quick)


if __name__ == "__main__":
    main()
