"""Buckets: the unit of communication.

A bucket packs several parameters (``comm_fusion``) so that one all-gather / reduce-scatter moves
all of them. The flat buffer is rank-major: ``(S, L)`` where column block ``[off_i, off_i + c_i)``
holds parameter i's padded rows of each rank, so rank r's slice of the flat buffer is exactly the
concatenation of its shards — the input / output of ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` without further copies. Below-threshold (replicated) parameters form
buckets of their own and are all-reduced over the whole data-parallel group. The gather and
reduce-scatter go through :mod:`._collectives` (gloo's CPU collectives done as one round of messages).

Memory: every transient communication buffer is at most one bucket (``HSDPConfig.bucket_size``; a
single parameter larger than it goes alone). Buckets never exceed it; a collective fused over several
buckets (the root's early all-gather of every stale unit, level 1's reduction at the end of backward)
is cut into *runs* of consecutive buckets that fit it; and at most one all-gather run is in flight at a
time (:class:`_GatherQueue`: the next run starts when the previous one has been read), at most one
reduction (``_state._launch_ready``; ``comm_async`` lifts that). So what a step adds to the model state
for communication is about two buckets (a gather's receive buffer, a reduction's send buffer and its
receive of S-1 chunks on gloo) — about three at level 3 in backward, where the next unit's gather
prefetch and the previous unit's reduction overlap — whatever the model size; the pool (_pool.py) then
never holds a block larger than a bucket either.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from hyper_adaptor.parallel.hsdp._collectives import all_gather, reduce_scatter
from hyper_adaptor.parallel.hsdp._config import HSDPConfig
from hyper_adaptor.parallel.hsdp._mesh import HSDPMesh
from hyper_adaptor.parallel.hsdp._param import HSDPParam
from hyper_adaptor.parallel.hsdp._pool import HostBufferPool


def _comm_bytes(p: HSDPParam, S: int) -> int:
    """Bytes of ``p`` in a bucket's gathered or reduced buffer (S padded chunks, in the larger of its
    compute and reduce dtypes): what the bucket size is counted in."""
    size = max(torch.empty((), dtype=p.compute_dtype).element_size(),
               torch.empty((), dtype=p.reduce_dtype).element_size())
    return p.chunk_numel * S * size


class Bucket:
    def __init__(self, params: list[HSDPParam], mesh: HSDPMesh, config: HSDPConfig, pool: HostBufferPool):
        self.params = params
        self.mesh = mesh
        self.config = config
        self.pool = pool
        self.sharded = params[0].sharded
        self.S = mesh.shard_size if self.sharded else 1
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.chunk_numel
        self.L = offset
        self.nbytes = sum(_comm_bytes(p, self.S) for p in params)
        self.device = params[0].device
        self.compute_dtype = params[0].compute_dtype
        self.reduce_dtype = params[0].reduce_dtype
        self.scale = config.grad_scale / mesh.dp_size  # gradients are averaged over data parallel, then scaled
        self.ready: set[int] = set()
        self._gather: _GatherRun | None = None  # the all-gather submitted for this bucket, not yet read
        self._reduce = None
        # Collective volume in the usual convention (all-gather / reduce-scatter: the full buffer,
        # all-reduce: twice it), to compare with the ZeRO theory in bench/hsdp.py.
        self.comm_bytes = 0

    def __iter__(self):
        return iter(zip(self.params, self.offsets))

    @property
    def wants_grad(self) -> bool:
        return any(p.full.requires_grad for p in self.params)

    # -- parameters ------------------------------------------------------------------------------
    def pack_params(self, send: torch.Tensor) -> None:
        """This rank's padded shards, flat, into ``send`` (L elements)."""
        for p, off in self:
            p.gather_input(send[off : off + p.chunk_numel])

    def start_gather(self, async_op: bool) -> None:
        if not self.sharded:
            for p in self.params:
                p.refresh_unsharded()
            return
        run = _GatherRun([self])
        _GATHERS.submit([run])
        if not async_op:
            _GATHERS.finish(run)

    def finish_gather(self) -> None:
        if self._gather is not None:
            _GATHERS.finish(self._gather)

    # -- gradients -------------------------------------------------------------------------------
    def pack_grads(self, blocks: torch.Tensor) -> None:
        """Every rank's padded gradient rows into ``blocks`` ((S, L), possibly strided)."""
        for p, off in self:
            p.reduce_input(blocks[:, off : off + p.chunk_numel])
            if not p.config.keeps_full_grads:
                p.full.grad = None  # packed: level 2/3 release the full gradient at once
            if p.config.reshard_after_forward and p.full.requires_grad and self.sharded:
                # Level 3: its gradient is final (autograd accumulates a leaf once, after every node
                # that uses it has run), so no node of this backward reads the full parameter again:
                # free it now rather than at the end of backward, where every unit's full parameters
                # were alive at once. (A later backward through a graph that saved it re-gathers it
                # first: the unit's pre-backward hook.)
                p.free_full()

    def accept_grads(self, out: torch.Tensor) -> None:
        """``out``: this rank's reduced (summed, not yet scaled) rows of the bucket."""
        out.mul_(self.scale)
        for p, off in self:
            if p.full.requires_grad:
                p.accept_reduced(out[off : off + p.chunk_numel])
        self.ready.clear()

    def start_reduce(self, async_op: bool) -> None:
        self._reduce = _Reduction([self], async_op)

    def finish_reduce(self) -> None:
        if self._reduce is not None:
            reduction, self._reduce = self._reduce, None
            reduction.finish()


def _fusable(buckets: list[Bucket], dtype_of) -> list[list[Bucket]]:
    """Buckets that can share one collective: same kind (sharded or not), dtype, device, groups, and
    the same buffer pool, gloo switches and bucket size (a fused collective runs with its first
    bucket's, so units wrapped with different settings never share one)."""
    groups: dict[tuple, list[Bucket]] = {}
    for b in buckets:
        key = (b.sharded, dtype_of(b), b.device, id(b.mesh.shard_group), id(b.mesh.dp_group),
               id(b.mesh.replicate_group), b.S, id(b.pool), b.config.gloo_reduce_scatter_as_all_to_all,
               b.config.gloo_all_gather_as_all_to_all, b.config.budget_bytes())
        groups.setdefault(key, []).append(b)
    return list(groups.values())


def _runs(members: list[Bucket], budget: int | None) -> list[list[Bucket]]:
    """``members`` (in order) cut into runs of consecutive buckets whose buffers together fit
    ``budget`` bytes (None: one run); a run holds at least one bucket. One collective per run: where
    everything fits, that is the single fused collective; where it does not, the transient buffer
    stays one bucket instead of growing with the model."""
    if budget is None:
        return [members]
    runs: list[list[Bucket]] = []
    current: list[Bucket] = []
    size = 0
    for b in members:
        if current and size + b.nbytes > budget:
            runs.append(current)
            current, size = [], 0
        current.append(b)
        size += b.nbytes
    if current:
        runs.append(current)
    return runs


class _GatherRun:
    """One all-gather for sharded buckets side by side (one bucket, or a run of a fused group): the
    rank-major receive buffer holds each bucket as a column block. Started by :class:`_GatherQueue`
    (always asynchronously: a blocking gather is started and read at once); reading it writes every
    member's full parameters and hands the receive buffer back to the pool."""

    def __init__(self, members: list[Bucket]):
        self.members = members
        self.launched = False
        self.done = False
        self.work = None
        self.recv: torch.Tensor | None = None
        for b in members:
            b._gather = self

    def launch(self) -> None:
        head = self.members[0]
        total = sum(b.L for b in self.members)
        send = torch.empty(total, dtype=head.compute_dtype, device=head.device)
        offset = 0
        for b in self.members:
            b.pack_params(send[offset : offset + b.L])
            b.comm_bytes += head.S * b.L * send.element_size()
            offset += b.L
        self.recv = head.pool.take(head.S * total, head.compute_dtype, head.device)
        self.work = all_gather(self.recv, send, head.mesh.shard_group, True, head.config.gloo_all_gather_as_all_to_all)
        self.launched = True

    def complete(self) -> None:
        head = self.members[0]
        self.work.wait()
        self.work = None
        blocks = self.recv.view(head.S, -1)
        offset = 0
        for b in self.members:
            for p, off in b:
                p.write_gathered(blocks[:, offset + off : offset + off + p.chunk_numel])
            b._gather = None
            offset += b.L
        head.pool.give(self.recv)
        self.recv = None
        self.done = True


class _GatherQueue:
    """The all-gathers submitted and not yet read, in the order they were submitted — the same on
    every rank, since every rank runs the same hooks in the same order, so the collectives match.

    At most one is in flight: the next starts when the one before it has been read. At levels 1/2 the
    root submits every stale unit's gather at once (in forward order); started together they held a
    receive buffer for the whole model. One at a time, each overlaps the forward compute of the unit
    before it, and one receive buffer (plus, on gloo, one repeated send) is alive. Level 3's prefetch
    was already one unit ahead; it is unchanged. Reading a run that has not started yet first starts
    and reads every run before it (they are due anyway, and the order is what ranks agree on)."""

    def __init__(self):
        self.runs: deque[_GatherRun] = deque()

    def submit(self, runs: list[_GatherRun]) -> None:
        self.runs.extend(runs)
        self._start_next()

    def _start_next(self) -> None:
        # runs are read in order, so only the oldest may be in flight
        if self.runs and not self.runs[0].launched:
            self.runs[0].launch()

    def finish(self, run: _GatherRun) -> None:
        while not run.done:
            head = self.runs.popleft()
            if not head.launched:
                head.launch()
            head.complete()
            self._start_next()


# One queue per process: autograd and the module hooks run on one thread.
_GATHERS = _GatherQueue()


def gather_fused(buckets: list[Bucket], async_op: bool) -> None:
    """Start the all-gather of several buckets as one collective per compatible group and run of at
    most a bucket size (:func:`_runs`). Fewer, larger collectives: each one is a rendezvous of every
    rank, which costs more than its bytes on a loaded host."""
    runs = []
    for members in _fusable(buckets, lambda b: b.compute_dtype):
        if members[0].sharded:
            runs += [_GatherRun(run) for run in _runs(members, members[0].config.budget_bytes())]
        else:
            for b in members:
                b.start_gather(async_op)
    _GATHERS.submit(runs)
    if not async_op:
        for run in runs:
            _GATHERS.finish(run)


class _Reduction:
    """One gradient reduction of buckets side by side (one bucket, or a run of a fused group): a
    reduce-scatter over the shard group (then an all-reduce over the replicas when hybrid), or an
    all-reduce over data parallel for whole (below-threshold) parameters; ``finish`` waits and hands
    each bucket its rows."""

    def __init__(self, members: list[Bucket], async_op: bool):
        head = self.head = members[0]
        self.members = members
        total = sum(b.L for b in members)
        if head.sharded:
            send = head.pool.take(head.S * total, head.reduce_dtype, head.device)
        else:  # all-reduced in place: the buffer becomes the gradients (not pooled)
            send = torch.empty(head.S * total, dtype=head.reduce_dtype, device=head.device)
        blocks = send.view(head.S, total)
        offset = 0
        for b in members:
            b.pack_grads(blocks[:, offset : offset + b.L])
            offset += b.L
        if head.sharded:
            self.out = torch.empty(total, dtype=head.reduce_dtype, device=head.device)
            self.work = reduce_scatter(self.out, send, head.mesh.shard_group, async_op, head.pool,
                                       head.config.gloo_reduce_scatter_as_all_to_all)
            self.send = send
        else:
            self.out = send
            self.work = dist.all_reduce(send, group=head.mesh.dp_group, async_op=async_op)
            self.send = None

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.send is not None:
            self.head.pool.give(self.send)
        head, out = self.head, self.out
        hybrid = head.sharded and head.mesh.replicas > 1
        if hybrid:
            dist.all_reduce(out, group=head.mesh.replicate_group)
        # volume in the usual convention: reduce-scatter the full buffer, all-reduce twice it
        element = out.element_size()
        offset = 0
        for b in self.members:
            b.comm_bytes += head.S * b.L * element * (1 if head.sharded else 2) + (2 * b.L * element if hybrid else 0)
            b.accept_grads(out[offset : offset + b.L])
            offset += b.L


def reduce_fused(buckets: list[Bucket]) -> None:
    """Reduce several buckets now: one collective per compatible group and run of at most a bucket
    size, one after the other (each run's buffers are back in the pool before the next is packed)."""
    for members in _fusable(buckets, lambda b: b.reduce_dtype):
        for run in _runs(members, members[0].config.budget_bytes()):
            _Reduction(run, async_op=False).finish()


def make_buckets(params: list[HSDPParam], mesh: HSDPMesh, config: HSDPConfig, pool: HostBufferPool) -> list[Bucket]:
    """Buckets in backward order (the reverse of registration), never mixing sharded with
    replicated parameters or different dtypes. ``config.bucket_bytes()``: None one bucket per kind,
    0 one bucket per parameter, else a bucket holds at most that many bytes (:func:`_comm_bytes`): it
    closes before a parameter that would overflow it, so only a parameter larger than the bucket size
    makes a larger bucket (alone)."""
    bucket_bytes = config.bucket_bytes()
    buckets: list[Bucket] = []
    open_: dict[tuple, list[HSDPParam]] = {}
    sizes: dict[tuple, int] = {}

    def close(key):
        if open_.get(key):
            buckets.append(Bucket(open_.pop(key), mesh, config, pool))
            sizes.pop(key, None)

    for p in reversed(params):
        key = (p.sharded, p.compute_dtype, p.reduce_dtype)
        nbytes = _comm_bytes(p, mesh.shard_size if p.sharded else 1)
        if bucket_bytes is not None and open_.get(key) and sizes[key] + nbytes > bucket_bytes:
            close(key)
        open_.setdefault(key, []).append(p)
        sizes[key] = sizes.get(key, 0) + nbytes
        if bucket_bytes is not None and sizes[key] >= bucket_bytes:
            close(key)
    for key in list(open_):
        close(key)
    return buckets
