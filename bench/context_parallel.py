"""Context parallel (hyper_adaptor.parallel.context): per-rank activation memory, step time and
communication of one transformer layer at CP 1, 2 and 4 for each algorithm, against the theory, and the
longest sequence that fits one per-process memory budget.

Run from the repository root::

    python bench/context_parallel.py            # about 3 minutes on 2 idle CPU cores (longer when shared)
    python bench/context_parallel.py --quick    # short sequences, one timed round (smoke run, < 1 minute)

One gloo world of 4 ranks (hyper_adaptor/testing/world.py; one torch thread per rank), fp32, CPU. Every
rank is busy in every configuration, as on a 4-device node: CP N runs 4/N CP groups of consecutive
ranks side by side (data parallel 4/N), all groups on the same sequence. The groups come from
``build_cp_groups`` (CP 4 hybrid: ``ulysses_degree=2``, Ulysses inside {0,1} and {2,3}, ring across).

The layer (the same seeded weights on every rank): ``qkv = x @ W_qkv`` split into q [s, b, np, hn] and
k, v [s, b, ng, hn] (views, as megatron passes them); causal core attention; ``y = x + attn @ W_o``;
``z = y + gelu(y @ W_1) @ W_2`` (ffn = 4 x hidden); then ``z.backward(dz)`` with a given output gradient
(x is a leaf that wants its gradient, as a layer's input does). Core attention: at CP 1
``hyper_adaptor.ops.attention.attention(causal=True)``, otherwise
``context_parallel_attention(..., algo=A, causal=True, load_balanced=True)`` for A in ulysses, ring,
allgather and (CP 4 only; at CP 2 it is Ulysses) hybrid. Every algorithm gets megatron's load-balanced
layout (``get_batch_on_this_cp_rank``: 2N chunks, rank r holds chunks r and 2N-1-r). Attention kernels:
the default ("fast") backend, PyTorch's flash kernels on CPU, O(s) memory.

What is measured, per sequence length S (the global sequence of one CP group), CP size N and algorithm
--------------------------------------------------------------------------------------------------
* parity, at the first (shortest) S: this rank's output z and input gradient dx, and the weight
  gradients summed over the CP group, against the same layer run on the whole sequence in one process
  (max |diff| / max |reference|); printed so that a wrong engine cannot hide behind good figures.
* memory per rank, counted by a storage tracker (``LiveStorages``, a TorchDispatchMode): every storage
  an operator returns that it was not given is a new allocation, counted from its creation until a
  finalizer on the storage reports its free, in whichever thread that happens; the running total's
  maximum is the peak above what existed before. It sees every tensor the step creates: saved
  activations, the engines' communication receive buffers (``torch.empty_like``) and reordering
  copies, outputs, gradients, softmax scores where a backend materialises them. It does not see
  buffers a kernel allocates and frees inside itself (the flash kernel's per-thread blocks, constant in
  the sequence length) nor gloo's internal staging. Cross-check: the PyTorch profiler
  (``profile_memory=True``, every CPU allocator event with its size, kernels' internal buffers included,
  summed in time order) over the same layer step; it agrees to the byte at CP 1, but it cannot see a free
  run in one of gloo's threads (a buffer whose last reference a finished send drops there), so at CP > 1
  it overstates by whatever such frees it missed, differently from run to run; hence the tracker.
  Gradients are set to None before, never inside, a measured step. A buffer a finished send releases
  in a gloo thread is alive until then, so a rank's peak can differ by such a buffer from run to run.
  Figures, max over the ranks:
    - ``layer peak``: the whole layer step (activations, transient and communication buffers, dx and
      the weight gradients); ``layer activations``: the same running total without the weight
      gradients (they do not shrink with CP);
    - ``attention``: the core attention alone, forward + backward on this rank's shard from leaf q, k, v
      and a given output gradient: those four inputs (a layer holds them for attention at every CP size;
      q, k, v are saved for its backward) + the peak of what attention allocates (its saved tensors,
      communication and reordering buffers, output, dq, dk, dv). Printed for the longest sequence: what
      forward leaves alive (inputs + saved tensors + output) and what the peak holds, by creating operator.
  Each is compared with CP 1's figure divided by N (target <= 1.1).
* ``per-process memory`` = parameters + this rank's x and dz (alive before the step) + layer peak.
* communication per rank in that same (measured) layer step: torch.distributed's functions are wrapped
  (every module-level alias rebound) and each call counts the bytes this rank sends, as the
  bandwidth-optimal schedule of the collective does (all of them move (N-1)/N of their buffer):
  all-to-all the input minus this rank's own piece, all-gather (N-1) x its input, reduce-scatter
  (N-1) x its output, all-reduce 2(N-1)/N of the tensor, point-to-point the sent tensors
  (``batch_isend_irecv``'s isends); nested calls count once. (That is the volume an algorithm asks
  for, not what gloo moves internally: gloo's reduce-scatter is an all-reduce, for one.) The ring's own
  ``RingStats.bytes_sent`` is printed beside it. Theory per rank, with s = S/N local rows, b the batch,
  e = 4 bytes, Q = s b np hn e (this rank's q, = its output), K = s b ng' hn e (its k, = its v; ng' = ng
  repeated to a multiple of the Ulysses degree where needed):
    - Ulysses:   forward all-to-all of q, k, v and the output, backward of their gradients, each moving
                 (N-1)/N of the local tensor: 2 x (N-1)/N x (2Q + 2K);
    - ring:      forward N-1 K/V blocks: (N-1) 2K; backward K/V N-1 hops again and the fp32 dK/dV
                 accumulators N hops (they leave with the block and return to the owner after the last
                 step): (N-1) 2K + N 2K_fp32;
    - all-gather: forward (N-1) local K/V blocks, backward reduce-scatter of dK/dV: 4 (N-1) K;
    - hybrid U x G: Ulysses inside U, 2 x (U-1)/U x (2Q + 2K), then the ring over G on the head slice
                 of the whole group's rows (the same bytes as the local shard): (G-1) 2K + (G-1) 2K +
                 G 2K_fp32. Target: within 5 %.
  (A ring could send the dK/dV accumulators N-1 times, skipping the zeros of the first hop; the engine
  sends them N times, so that is the theory the figure is held to; the minimum is in the JSON.)
* step time: after a warm-up round, rounds of one layer step per algorithm, interleaved (reversed order
  on odd rounds) so that machine drift falls on all alike; a barrier before each step; a step's time is
  the slowest rank's; the median over the rounds. Reported with the world's throughput (tokens of all
  4/N CP groups per second) and, at each CP size, as a ratio to Ulysses (target for the load-balanced
  ring at CP 2: within 10 %).
* the longest sequence that fits the per-process budget (``--budget-mib``): at CP 1 and for each
  algorithm at CP 4, per-process memory (max over ranks) is measured by tracked layer steps at probe
  lengths: the first probe is on the line through the sweep's two longest, then a galloping search
  (steps of 64 tokens doubling) brackets the answer and bisection narrows it to 64 tokens. Target:
  CP 4's >= 3.5 x CP 1's.

Tests never assert timings; this prints them with the machine (and its load average, the machine being
shared) and writes bench/results/context_parallel.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import math
import os
import statistics
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "context_parallel.json"
WORLD = 4
CP_SIZES = (1, 2, 4)
ALGORITHMS = ("ulysses", "ring", "allgather", "hybrid")
HYBRID_ULYSSES = 2  # hybrid at CP 4 = 2 (Ulysses) x 2 (ring)
SEED = 1234
GRANULE = 64  # sequence lengths searched in steps of this (divisible by 2N for the load-balanced layout)
MAX_PROBES = 20
ELEMENT = 4  # fp32
TARGETS = {"attention_memory": 1.1, "comm": 0.05, "longest": 3.5, "ring_vs_ulysses_cp2": 0.10}


def contenders(n: int, algos) -> list[str]:
    """What runs at CP n: plain attention at 1; hybrid needs 1 < U < N, so CP 4 only."""
    if n == 1:
        return ["attention"]
    return [a for a in algos if a != "hybrid" or n > HYBRID_ULYSSES]


# --------------------------------------------------------------------------------------------------
# communication counter
# --------------------------------------------------------------------------------------------------
def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _a2a_single(a, n, r):
    split = a.get("input_split_sizes")
    total = _nbytes(a["input"])
    if split:
        return total - total * split[r] // sum(split)
    return total * (n - 1) // n


def _p2p_sent(a, n, r):
    # only the isends: every receive is some rank's send, counted there
    from torch.distributed import distributed_c10d as c10d

    return sum(_nbytes(op.tensor) for op in a["p2p_op_list"] if getattr(op.op, "__name__", "") == "isend"
               or op.op is c10d.isend)


# function -> bytes this rank sends in the bandwidth-optimal schedule, from its bound arguments
_SENT = {
    "all_to_all_single": _a2a_single,
    "all_to_all": lambda a, n, r: sum(_nbytes(t) for i, t in enumerate(a["input_tensor_list"]) if i != r),
    "all_gather_into_tensor": lambda a, n, r: (n - 1) * _nbytes(a["input_tensor"]),
    "all_gather_single": lambda a, n, r: (n - 1) * _nbytes(a["input_tensor"]),  # torch 2.13's new names
    "_all_gather_base": lambda a, n, r: (n - 1) * _nbytes(a["input_tensor"]),
    "all_gather": lambda a, n, r: (n - 1) * _nbytes(a["tensor"]),
    "reduce_scatter_tensor": lambda a, n, r: (n - 1) * _nbytes(a["output"]),
    "reduce_scatter_single": lambda a, n, r: (n - 1) * _nbytes(a["output"]),
    "_reduce_scatter_base": lambda a, n, r: (n - 1) * _nbytes(a["output"]),
    "reduce_scatter": lambda a, n, r: (n - 1) * _nbytes(a["output"]),
    "all_reduce": lambda a, n, r: 2 * (n - 1) * _nbytes(a["tensor"]) // n,
    "send": lambda a, n, r: _nbytes(a["tensor"]),
    "isend": lambda a, n, r: _nbytes(a["tensor"]),
    "batch_isend_irecv": _p2p_sent,
}


class CommCounter:
    """Bytes this rank sends through torch.distributed while ``phase`` is set, by phase and function.

    Every module-level alias of the wrapped functions is rebound, c10d's own names included: P2POp and
    ``batch_isend_irecv`` compare ``op.op is isend`` against c10d's global, which must stay the same
    object as the ``dist.isend`` an engine passes in."""

    def __init__(self):
        self.phase = None
        self.depth = 0
        self.counts: dict = {}
        self._installed = []

    def install(self) -> None:
        from bench import _results as bench_results

        self._installed = bench_results.rebind_c10d(_SENT, self._wrap)

    def uninstall(self) -> None:
        from bench import _results as bench_results

        bench_results.restore(self._installed)
        self._installed = []

    def _wrap(self, name, fn):
        signature = inspect.signature(fn)
        sent = _SENT[name]

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self.phase is not None and self.depth == 0:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                a = bound.arguments
                group = a.get("group")
                if name == "batch_isend_irecv":
                    group = a["p2p_op_list"][0].group if a["p2p_op_list"] else None
                n, r = dist.get_world_size(group), dist.get_rank(group)
                nbytes = 0 if n == 1 else sent(a, n, r)
                entry = self.counts.setdefault(self.phase, {}).setdefault(name, [0, 0])
                entry[0] += 1
                entry[1] += nbytes
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted

    def take(self) -> dict:
        """{phase: {"bytes": total, "ops": {name: {"calls", "bytes"}}}} since the last take."""
        out = {phase: {"bytes": sum(v[1] for v in ops.values()),
                       "ops": {k: {"calls": v[0], "bytes": v[1]} for k, v in sorted(ops.items())}}
               for phase, ops in self.counts.items()}
        self.counts = {}
        return out


# --------------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------------
class LiveStorages(TorchDispatchMode):
    """Bytes of the storages operators create while the mode is on, from creation until freed; peak.

    A storage is new when an operator returns it and did not receive it (views and in-place results
    share an input's storage; a tensor that existed before, like dz or a weight, arrives as an input the
    first time it is seen, so it is never counted). Its free is seen by a finalizer on the storage
    object, which torch keeps alive exactly as long as the storage (and which runs in whichever thread
    drops the last reference: gloo's worker threads release the buffers of finished sends)."""

    def __init__(self):
        super().__init__()
        self.lock = threading.RLock()  # re-entrant: a free may run inside ``_track`` on this thread
        self.live = self.peak = 0
        self.tracked: dict[int, tuple] = {}  # id(storage object) -> (bytes, creating op, weakref, serial)
        self.at_peak: list[tuple] = []  # what was alive at the peak, to say what it is made of
        self.timeline: list[tuple[int, int]] = []  # (serial, +-bytes) in order, to leave storages out later

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if id(storage) not in given or id(storage) in self.tracked:
                    self._track(storage, func)
        return out

    def _track(self, storage, func) -> None:
        key, nbytes = id(storage), storage.nbytes()
        with self.lock:
            known = self.tracked.get(key)
            counted = known[0] if known else 0
            if known is None:
                serial = len(self.timeline)
                weakref.finalize(storage, self._freed, key)
            elif nbytes <= counted:
                return
            else:  # seen again with more bytes: resized by an out= operator
                serial = known[3]
            self.tracked[key] = (nbytes, str(func.overloadpacket), weakref.ref(storage), serial)
            self.timeline.append((serial, nbytes - counted))
            self.live += nbytes - counted
            if self.live > self.peak:
                self.peak = self.live
                self.at_peak = list(self.tracked.values())

    def _freed(self, key) -> None:
        with self.lock:
            nbytes, _, _, serial = self.tracked.pop(key)
            self.timeline.append((serial, -nbytes))
            self.live -= nbytes

    def peak_by_op(self) -> dict[str, int]:
        """Bytes alive at the peak by the operator that created them, largest first."""
        by_op: dict[str, int] = {}
        for nbytes, op, _, _ in self.at_peak:
            by_op[op] = by_op.get(op, 0) + nbytes
        return dict(sorted(by_op.items(), key=lambda kv: -kv[1]))

    def peak_without(self, tensors) -> int:
        """The peak of the same running total with ``tensors``' storages (created during the run and
        still alive) left out."""
        mine = {id(t.untyped_storage()) for t in tensors if t is not None}
        left_out = {serial for _, _, ref, serial in self.tracked.values()
                    if ref() is not None and id(ref()) in mine}
        total = peak = 0
        for serial, delta in self.timeline:
            if serial not in left_out:
                total += delta
                peak = max(peak, total)
        return peak


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
            tracker: LiveStorages | None = None) -> tuple[LiveStorages, int | None]:
    """Run ``fn()`` under the storage tracker (and the profiler, as a cross-check): (tracker, profiler's
    peak or None)."""
    tracker = LiveStorages() if tracker is None else tracker
    if not with_profiler:
        with tracker:
            fn()
        return tracker, None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, tracker:
        fn()
    return tracker, profiler_peak(prof)


# --------------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------------
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
        self.counter = CommCounter()
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
        return sum(_nbytes(p) for p in self.params.values()) + _nbytes(x) + _nbytes(dz)

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
        tracker, after_forward = LiveStorages(), []

        def step():
            out = core(q, k, v)
            after_forward.append(tracker.live)  # what forward leaves for backward, and its output
            out.backward(dout)

        tracker, profiler = measure(step, with_profiler=True, tracker=tracker)
        return {"attention_inputs": _nbytes([q, k, v, dout]), "attention_peak": tracker.peak,
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


# --------------------------------------------------------------------------------------------------
# the longest sequence under the budget
# --------------------------------------------------------------------------------------------------
def longest_sequence(memory_at, budget: int, first_guess: int, granule: int) -> dict:
    """The longest multiple of ``granule`` whose ``memory_at(seq)`` (bytes) is <= ``budget``: gallop from
    ``first_guess`` (steps of one granule, doubling) until the answer is bracketed, then bisect."""
    probes = {}

    def fits(seq):
        if seq not in probes:
            if len(probes) >= MAX_PROBES:
                raise RuntimeError(f"longest sequence: no answer after {MAX_PROBES} probes {probes}")
            probes[seq] = memory_at(seq)
        return probes[seq] <= budget

    guess = max(granule, first_guess // granule * granule)
    step = granule
    if fits(guess):
        lo, hi = guess, guess + step
        while fits(hi):
            lo, step = hi, step * 2
            hi = lo + step
    else:
        hi, lo = guess, guess - step
        while lo >= granule and not fits(lo):
            hi, step = lo, step * 2
            lo = hi - step
        if lo < granule:
            if not fits(granule):
                return {"seq": 0, "bytes": None, "probes": probes}
            lo = granule
    while hi - lo > granule:
        mid = (lo + hi) // 2 // granule * granule
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"seq": lo, "bytes": probes[lo], "probes": probes}


def linear_guess(points: dict, budget: int) -> int:
    """Where the line through the two longest of {seq: bytes} reaches the budget (memory is affine in
    the sequence once activations outweigh the weight gradients, which the short ones may not)."""
    (x0, y0), (x1, y1) = sorted(points.items())[-2:] if len(points) > 1 else ((0, 0), *points.items())
    slope = (y1 - y0) / (x1 - x0)
    return int(x1 + (budget - y1) / slope) if slope > 0 else x1


# --------------------------------------------------------------------------------------------------
# one rank
# --------------------------------------------------------------------------------------------------
def bench_rank(rank: int, world_size: int, dims: dict, seqs: list, algos: list, warmup: int, rounds: int,
               budget: int, search: bool) -> dict:
    import warnings

    # megatron's import-time notices (no TE / apex) and torch 2.13's deprecation of the c10d names the
    # engines call (all_gather_into_tensor, reduce_scatter_tensor): not this benchmark's figures
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    me = Rank(rank, dims, algos)
    me.counter.install()
    rows = []
    try:
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
    finally:
        me.counter.uninstall()
    return {"rows": rows, "longest": longest}


# --------------------------------------------------------------------------------------------------
# theory
# --------------------------------------------------------------------------------------------------
def kv_heads_for(ng: int, degree: int) -> int:
    """ng repeated as Ulysses does: each kv head degree / gcd(ng, degree) times."""
    return ng * (degree // math.gcd(ng, degree))


def theory(algo: str, n: int, seq: int, dims: dict) -> dict:
    """Bytes this rank sends per layer, forward and backward (see the module doc); ``formula`` in words."""
    s, b, nh, ng, hn = seq // n, dims["batch"], dims["heads"], dims["kv_heads"], dims["head_dim"]
    if n == 1 or algo == "attention":
        return {"forward": 0, "backward": 0, "minimum": 0, "formula": "0"}
    q = s * b * nh * hn * ELEMENT
    if algo == "ulysses":
        kv = s * b * kv_heads_for(ng, n) * hn * ELEMENT
        each = (n - 1) * (2 * q + 2 * kv) / n
        return {"forward": each, "backward": each, "minimum": 2 * each, "formula": "2(N-1)/N(2Q+2K)"}
    if algo == "allgather":
        kv = s * b * ng * hn * ELEMENT
        return {"forward": 2 * (n - 1) * kv, "backward": 2 * (n - 1) * kv, "minimum": 4 * (n - 1) * kv,
                "formula": "4(N-1)K"}
    if algo == "ring":
        u, g = 1, n
        ulysses_each, kv = 0.0, s * b * ng * hn * ELEMENT
    else:  # hybrid
        u, g = HYBRID_ULYSSES, n // HYBRID_ULYSSES
        kv = s * b * kv_heads_for(ng, u) * hn * ELEMENT  # the head slice of U x s rows: the same bytes
        ulysses_each = (u - 1) * (2 * q + 2 * kv) / u
    kv_fp32 = kv * 4 // ELEMENT  # the travelling dK/dV accumulators are fp32
    forward = ulysses_each + (g - 1) * 2 * kv
    backward = ulysses_each + (g - 1) * 2 * kv + g * 2 * kv_fp32
    minimum = forward + backward - 2 * kv_fp32
    formula = "2(N-1)K + 2(N-1)K + 2N K32" if algo == "ring" else "2(U-1)/U(2Q+2K) + 2(G-1)K + 2(G-1)K + 2G K32"
    return {"forward": forward, "backward": backward, "minimum": minimum, "formula": formula}


# --------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------
def _merge(results: list, dims: dict) -> tuple[list, list]:
    """Rows with per-rank figures combined (memory and communication: the maximum over the ranks)."""
    rows = []
    for i, row in enumerate(results[0]["rows"]):
        per_rank = [res["rows"][i] for res in results]
        n, seq, name = row["cp"], row["seq"], row["algorithm"]
        comm = [sum(r["comm"].get(p, {"bytes": 0})["bytes"] for p in ("forward", "backward")) for r in per_rank]
        t = theory(name, n, seq, dims)
        out = {
            "seq": seq, "cp": n, "dp": WORLD // n, "algorithm": name,
            "step_ms_median": statistics.median(row["step_s"]) * 1000 if row["step_s"] else None,
            "step_ms_all": [x * 1000 for x in row["step_s"]],
            "layer_peak_bytes": max(r["layer_peak"] for r in per_rank),
            "layer_peak_bytes_per_rank": [r["layer_peak"] for r in per_rank],
            "layer_peak_profiler_bytes": max(r["layer_peak_profiler"] for r in per_rank),
            "layer_activation_bytes": max(r["layer_activation_peak"] for r in per_rank),
            "layer_peak_by_op_rank0": row["layer_peak_by_op"],
            "attention_peak_by_op_rank0": row["attention_peak_by_op"],
            "attention_bytes": max(r["attention_inputs"] + r["attention_peak"] for r in per_rank),
            "attention_inputs_bytes": max(r["attention_inputs"] for r in per_rank),
            "attention_peak_bytes": max(r["attention_peak"] for r in per_rank),
            "attention_after_forward_bytes": max(r["attention_inputs"] + r["attention_after_forward"]
                                                 for r in per_rank),
            "attention_peak_profiler_bytes": max(r["attention_peak_profiler"] for r in per_rank),
            "static_bytes": max(r["static"] for r in per_rank),
            "comm_bytes": max(comm), "comm_bytes_per_rank": comm,
            "comm_forward_bytes": max(r["comm"].get("forward", {"bytes": 0})["bytes"] for r in per_rank),
            "comm_backward_bytes": max(r["comm"].get("backward", {"bytes": 0})["bytes"] for r in per_rank),
            "comm_ops_rank0": row["comm"],
            "ring_stats_bytes_sent": [r["ring_stats_bytes_sent"] for r in per_rank],
            "comm_theory_forward_bytes": t["forward"], "comm_theory_backward_bytes": t["backward"],
            "comm_theory_bytes": t["forward"] + t["backward"], "comm_minimum_bytes": t["minimum"],
            "comm_formula": t["formula"],
            "parity_max_rel_err": (max(max(r["parity"].values()) for r in per_rank) if "parity" in row else None),
        }
        theory_total = out["comm_theory_bytes"]
        out["comm_vs_theory"] = (out["comm_bytes"] / theory_total) if theory_total else None
        rows.append(out)
    # ratios against CP 1 (memory) and Ulysses at the same CP (time)
    for out in rows:
        base = next(r for r in rows if r["seq"] == out["seq"] and r["cp"] == 1)
        for key in ("layer_peak", "layer_activation", "attention", "attention_after_forward"):
            out[f"{key}_vs_cp1_over_cp"] = out[f"{key}_bytes"] / (base[f"{key}_bytes"] / out["cp"])
        ulysses = next((r for r in rows if r["seq"] == out["seq"] and r["cp"] == out["cp"]
                        and r["algorithm"] == "ulysses"), None)
        out["step_vs_ulysses"] = (out["step_ms_median"] / ulysses["step_ms_median"]
                                  if ulysses and out["step_ms_median"] and ulysses["step_ms_median"] else None)
        out["world_tokens_per_s"] = (out["dp"] * out["seq"] / (out["step_ms_median"] / 1000)
                                     if out["step_ms_median"] else None)
    longest = results[0]["longest"]
    cp1 = next((x["seq"] for x in longest if x["cp"] == 1), None)
    for x in longest:
        x["vs_cp1"] = x["seq"] / cp1 if cp1 else None
    return rows, longest


def targets(rows: list, longest: list) -> list[dict]:
    """Each target of issue 14, checked where it applies (memory at the longest swept sequence)."""
    out = []
    top = max(r["seq"] for r in rows)
    for key, what in (("attention", "core attention memory (alone)"), ("layer_activation", "layer activations")):
        for r in rows:
            if r["cp"] > 1 and r["seq"] == top:
                ratio = r[f"{key}_vs_cp1_over_cp"]
                out.append({"target": f"{what} <= {TARGETS['attention_memory']} x CP1/CP",
                            "where": f"seq {top} CP {r['cp']} {r['algorithm']}", "value": ratio,
                            "met": ratio <= TARGETS["attention_memory"]})
    for r in rows:
        if r["comm_vs_theory"] is not None:
            out.append({"target": f"communication within {TARGETS['comm']:.0%} of theory",
                        "where": f"seq {r['seq']} CP {r['cp']} {r['algorithm']}", "value": r["comm_vs_theory"],
                        "met": abs(r["comm_vs_theory"] - 1) <= TARGETS["comm"]})
    for x in longest:
        if x["cp"] > 1:
            out.append({"target": f"longest sequence at CP {x['cp']} >= {TARGETS['longest']} x CP 1's",
                        "where": x["algorithm"], "value": x["vs_cp1"],
                        "met": x["vs_cp1"] is not None and x["vs_cp1"] >= TARGETS["longest"]})
    for r in rows:
        if r["cp"] == 2 and r["algorithm"] == "ring" and r["step_vs_ulysses"] is not None:
            out.append({"target": f"load-balanced ring within {TARGETS['ring_vs_ulysses_cp2']:.0%} of Ulysses "
                                  "step time at CP 2",
                        "where": f"seq {r['seq']}", "value": r["step_vs_ulysses"],
                        "met": r["step_vs_ulysses"] <= 1 + TARGETS["ring_vs_ulysses_cp2"]})
    return out


def run(args) -> dict:
    from hyper_adaptor.testing import run_world

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
    rows, longest = _merge(results, dims)
    from bench import _results as bench_results

    machine = bench_results.machine()
    machine.update(torch_threads=1, ranks=WORLD,
                   load_average_1min_before_after=[load_before[0], os.getloadavg()[0]])
    result = {
        "benchmark": "context_parallel", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python bench/context_parallel.py" + (" --quick" if args.quick else ""),
        "world": WORLD, "dtype": "fp32", "device": "cpu",
        "layer": dict(dims, causal=True, load_balanced=True, attention_backend="fast (PyTorch flash kernels)"),
        "seqs": seqs, "warmup": args.warmup, "rounds": args.rounds,
        "budget_bytes": budget, "granule": GRANULE,
        "memory_method": "storage tracker (bench/context_parallel.py LiveStorages, a TorchDispatchMode): bytes "
                         "of every storage an operator creates, from creation until a finalizer sees it freed "
                         "(any thread); peak of the running total over forward+backward. Cross-check "
                         "(*_profiler_bytes): torch.profiler profile_memory=True allocator events in time order",
        "comm_method": "torch.distributed functions wrapped; bytes this rank sends in the bandwidth-optimal "
                       "schedule of each collective; point-to-point isends",
        "rows": rows, "longest": longest, "wall_s": time.perf_counter() - start,
        "machine": machine,
    }
    result["targets"] = targets(rows, longest)
    return result


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def _f(x, spec) -> str:
    return "-" if x is None else format(x, spec)


def _top(by_op: dict, k: int = 4) -> str:
    return ", ".join(f"{op.removeprefix('aten.')} {_mib(b)}" for op, b in list(by_op.items())[:k])


def table(result: dict) -> str:
    head = ("seq", "CP x DP", "algorithm", "step ms", "x Ulysses", "world tok/s", "layer peak MiB (x CP1/CP)",
            "layer activations MiB (x CP1/CP)", "attention MiB (x CP1/CP)", "comm MiB fwd + bwd",
            "theory MiB (formula)", "x theory", "RingStats MiB", "parity")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        ring = r["ring_stats_bytes_sent"][0]
        lines.append("| " + " | ".join((
            str(r["seq"]), f"{r['cp']} x {r['dp']}", r["algorithm"], _f(r["step_ms_median"], ".0f"),
            _f(r["step_vs_ulysses"], ".2f"), _f(r["world_tokens_per_s"], ",.0f"),
            f"{_mib(r['layer_peak_bytes'])} ({r['layer_peak_vs_cp1_over_cp']:.2f})",
            f"{_mib(r['layer_activation_bytes'])} ({r['layer_activation_vs_cp1_over_cp']:.2f})",
            f"{_mib(r['attention_bytes'])} ({r['attention_vs_cp1_over_cp']:.2f})",
            f"{_mib(r['comm_forward_bytes'])} + {_mib(r['comm_backward_bytes'])}",
            f"{_mib(r['comm_theory_bytes'])} ({r['comm_formula']})", _f(r["comm_vs_theory"], ".3f"),
            _mib(ring), _f(r["parity_max_rel_err"], ".1e"),
        )) + " |")
    d = result["layer"]
    profiler_gap = max(abs(r["layer_peak_profiler_bytes"] - r["layer_peak_bytes"]) for r in result["rows"])
    cp1_gap = max(abs(r["layer_peak_profiler_bytes"] - r["layer_peak_bytes"]) for r in result["rows"] if r["cp"] == 1)
    notes = [
        "",
        f"Layer: hidden {d['hidden']}, {d['heads']} query heads, {d['kv_heads']} kv heads, head dim {d['head_dim']}, "
        f"ffn {d['ffn']}, batch {d['batch']}, fp32, causal, load-balanced layout; {result['world']} ranks "
        f"(CP x DP), one thread each; hybrid = {HYBRID_ULYSSES} (Ulysses) x "
        f"{result['world'] // HYBRID_ULYSSES} (ring).",
        "step ms: median over the interleaved rounds of the slowest rank's forward + backward; world tok/s: "
        "tokens of all DP groups per second; x Ulysses: step time over Ulysses' at the same CP.",
        "Memory per rank, max over ranks, from the storage tracker (bytes of the storages operators create, "
        "from creation to free): layer peak = peak over the layer's forward + backward; layer activations = "
        "the peak of the same running total without the weight gradients; attention = q, k, v and the "
        "output gradient of this rank's shard + the peak over the core attention's forward + backward "
        "alone; (x CP1/CP) = figure / (CP 1's figure / CP), target <= 1.1.",
        f"Cross-check, the profiler's allocator events over the same layer steps: largest difference "
        f"{_mib(profiler_gap)} MiB ({_mib(cp1_gap)} at CP 1; at CP > 1 the profiler misses frees run in "
        "gloo's threads).",
        "comm per rank per layer (bytes sent, bandwidth-optimal schedule of each collective). Q = s b np hn 4 B "
        "(local q), K = s b ng hn 4 B (local k, = v; ng repeated to a multiple of the Ulysses degree if "
        "needed), K32 = the fp32 dK/dV accumulator (= K in fp32), s = S/N, N = CP; U x G = hybrid's "
        "Ulysses x ring (2 x 2).",
        "parity: max relative error of z, dx and the CP-summed weight gradients vs one process on the whole "
        "sequence (first sequence length only).",
        "",
        f"Core attention at seq {max(result['seqs'])}: inputs + what forward leaves alive (saved for backward, "
        "and the output), and what the peak holds (rank 0, MiB by creating operator):",
    ]
    for r in result["rows"]:
        if r["seq"] == max(result["seqs"]):
            notes.append(f"  CP {r['cp']} {r['algorithm']}: after forward {_mib(r['attention_after_forward_bytes'])} "
                         f"(x CP1/CP {r['attention_after_forward_vs_cp1_over_cp']:.2f}); at the peak: inputs "
                         f"{_mib(r['attention_inputs_bytes'])} + {_top(r['attention_peak_by_op_rank0'])}")
    if result["longest"]:
        notes += ["", f"Longest sequence within {_mib(result['budget_bytes'])} MiB per process (parameters + x + dz "
                  f"+ layer peak, max over ranks; steps of {result['granule']} tokens):", "",
                  "| CP | algorithm | longest seq | MiB there | x CP 1 | probes (seq: MiB) | s |",
                  "|---|---|---|---|---|---|---|"]
        for x in result["longest"]:
            probes = ", ".join(f"{s}: {_mib(b)}" for s, b in sorted(x["probes"].items()))
            notes.append(f"| {x['cp']} | {x['algorithm']} | {x['seq']} | {_mib(x['bytes'])} | "
                         f"{_f(x['vs_cp1'], '.2f')} | {probes} | {x['seconds']:.0f} |")
    notes += ["", "Targets (issue 14), each checked where it applies (value, then met or NOT):"]
    from bench import _results as bench_results

    notes += bench_results.target_lines(result["targets"], ".3f")
    notes += ["", bench_results.machine_line(result)]
    return "\n".join(lines + notes)


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
    from bench import _results as bench_results

    result = run(args)
    return bench_results.report(result, table(result), args.json, quick=args.quick)


if __name__ == "__main__":
    main()
